"""The training loop on CPU: schedule, weight-decay groups, the exact token-averaged loss,
bitwise-identical resume after SIGKILL, and a clean stop on a NaN loss."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO
from longctx.data.loader import Curriculum, PackedDataset
from longctx.model.config import ModelConfig
from longctx.model.transformer import Transformer
from longctx.train import checkpoint
from longctx.train.batches import make_batch, sample_indices, step_samples
from longctx.train.loop import RunParams, TrainingDiverged, train
from longctx.train.optim import lr_at, param_groups


def test_schedule_warms_up_then_decays_to_the_floor():
    lrs = [lr_at(s, 100, 1e-3, 0.1, 1e-4) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:], strict=False))
    assert lrs[-1] == pytest.approx(1e-4, rel=1e-2)


def tiny_model(**kw) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=1024, d_model=32, n_layers=2, n_heads=4, ffn_dim=64,
                                   max_position_embeddings=2048, **kw), attention_backend="sdpa")


def test_no_weight_decay_on_norms_and_biases():
    from longctx.model.config import FoxConfig

    model = tiny_model(rope=None, fox=FoxConfig())
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(p.dim() == 2 for p in decay["params"])
    undecayed = {names[id(p)].split(".")[-2] + "." + names[id(p)].split(".")[-1] for p in no_decay["params"]}
    assert {"fgate.bias", "input_layernorm.weight", "q_norm.weight"} <= undecayed


def test_loss_is_the_mean_over_all_valid_tokens_of_the_step(small_project):
    data = PackedDataset(small_project / "data/packed/sft/train")
    model = tiny_model().double()
    samples = [0, 1, 2, 3]
    batches = [make_batch(data, [i], torch.device("cpu")) for i in samples]
    from longctx.model.loss import IGNORE

    valid = sum(int((b.labels != IGNORE).sum()) for b in batches)
    per_batch = [int((b.labels != IGNORE).sum()) for b in batches]
    assert len(set(per_batch)) > 1  # SFT: valid tokens differ between sequences
    total = sum(model(b.ids, b.cu_seqlens, labels=b.labels) / valid for b in batches)
    whole = make_batch(data, samples, torch.device("cpu"))
    logits = model(whole.ids, whole.cu_seqlens)
    plain = torch.nn.functional.cross_entropy(logits, whole.labels, ignore_index=IGNORE)
    torch.testing.assert_close(total, plain)


def test_unmasked_batches_let_a_sequences_documents_see_each_other(small_project):
    """train.*.document_mask false (issue 62's ablation): one document a packed sequence to
    attention, positions and labels; masked, a document's first token cannot see the one before."""
    from longctx.model.loss import IGNORE

    data = PackedDataset(small_project / "data/packed/stage1/train")
    i = next(i for i in range(len(data)) if len(data[i].cu_seqlens) > 2)  # a sequence of several documents
    masked, open_ = (make_batch(data, [i], torch.device("cpu"), documents=d) for d in (True, False))
    n = len(data[i].input_ids)
    assert open_.cu_seqlens.tolist() == [0, n] and len(masked.cu_seqlens) > 2
    assert torch.equal(open_.labels[:-1], open_.ids[1:]) and open_.labels[-1] == IGNORE
    cut = int(masked.cu_seqlens[1])
    assert masked.labels[cut - 1] == IGNORE and open_.labels[cut - 1] == open_.ids[cut]
    model = tiny_model().double()
    with torch.no_grad():  # the second document's logits change once it sees the first
        a, b = model(masked.ids, masked.cu_seqlens), model(open_.ids, open_.cu_seqlens)
    torch.testing.assert_close(a[:cut], b[:cut])
    assert not torch.allclose(a[cut:], b[cut:])
    from longctx.train.batches import step_batches
    from longctx.train.parallel import Parallel

    cfg = RunParams(steps=4, lr=1e-3, micro_batch=2, document_mask=False)  # the stage's path takes the switch
    samples, [step] = step_batches(data, 0, cfg, Parallel(device=torch.device("cpu")))
    lengths = [len(data[j].input_ids) for j in samples]
    assert len(step.cu_seqlens) == 3 and sorted(torch.diff(step.cu_seqlens).tolist()) == sorted(lengths)


def read_losses(path: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


def test_killed_run_resumes_bitwise(small_project, tmp_path):
    data = str(small_project / "data/packed/stage1/train")
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{REPO / 'tests'}"}
    worker = [sys.executable, str(REPO / "tests" / "train_worker.py")]
    subprocess.run([*worker, data, str(tmp_path / "straight"), "10", "2"], env=env, check=True, capture_output=True)
    # the same run, killed with SIGKILL once its step-4 checkpoint exists, then started again
    proc = subprocess.Popen([*worker, data, str(tmp_path / "killed"), "10", "2"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    target = tmp_path / "killed" / "checkpoints" / "step-00000004"
    deadline = time.time() + 300
    while not target.is_dir() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done = [p.name for p in checkpoint.checkpoints(tmp_path / "killed" / "checkpoints")]
    assert "step-00000010" not in done, "the run finished before it was killed"
    subprocess.run([*worker, data, str(tmp_path / "killed"), "10", "2"], env=env, check=True, capture_output=True)
    straight = read_losses(tmp_path / "straight" / "metrics.jsonl")
    resumed = read_losses(tmp_path / "killed" / "metrics.jsonl")
    assert len(straight) == 10 and resumed == straight  # exact floats: bitwise the same run


def test_nan_loss_stops_before_any_checkpoint(small_project, tmp_path):
    data = PackedDataset(small_project / "data/packed/stage1/train")
    model = tiny_model()
    cfg = RunParams(steps=4, lr=1e-3, checkpoint_every=1)
    train(model, data, cfg.model_copy(update={"steps": 2}), tmp_path)
    with torch.no_grad():
        model.layers[0].mlp.up_proj.weight.fill_(float("nan"))
    with pytest.raises(TrainingDiverged, match=r"step 0: loss is nan.*documents \[\[\{\"domain\""):
        train(model, data, cfg, tmp_path, resume=False)
    assert [p.name for p in checkpoint.checkpoints(tmp_path / "checkpoints")] == ["step-00000001", "step-00000002"]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_a_step_read_after_the_next_is_queued_still_names_itself(small_project, tmp_path, device):
    """On a GPU the loop reads each step's loss after queuing the next (a CPU checks it at once):
    a NaN at step 2 (of 0..5, a checkpoint every 3) is reported as step 2, with the steps before
    it logged, no checkpoint written and no NaN in the weights (the update was skipped)."""
    data = PackedDataset(small_project / "data/packed/stage1/train")
    model = tiny_model().to(device)
    calls = []

    def poison(_module, _inputs, out):
        calls.append(None)
        return out * float("nan") if len(calls) == 3 else out

    model.norm.register_forward_hook(poison)
    with pytest.raises(TrainingDiverged, match=r"^step 2: loss is nan"):
        train(model, data, RunParams(steps=6, lr=1e-3, checkpoint_every=3, compile=False), tmp_path)
    assert len(calls) == (4 if device == "cuda" else 3)  # on a GPU step 3 was queued before step 2 was read
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert not checkpoint.checkpoints(tmp_path / "checkpoints")
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_curriculum_trains_on_each_split_in_turn(small_project, tmp_path):
    """A stage's curriculum: its first steps draw from the first split alone, each of its sequences
    once per epoch, then the stage's own split from its first epoch on; one run, one schedule."""
    first, then = (PackedDataset(small_project / f"data/packed/{s}/train") for s in ("base", "stage1"))
    data = Curriculum([(first, 3), (then, 100)])
    assert len(data) == len(first) + len(then)
    steps = [step_samples(data, s, 2, 0) for s in range(5)]
    early = [i for s in steps[:3] for i in s]
    assert all(i < len(first) for i in early)
    assert len(set(early)) == min(6, len(first))  # an epoch's permutation, no repeat within it
    assert steps[3] == [len(first) + i for i in sample_indices(0, 2, len(then), 0)]
    assert data.provenance(steps[3][0])[0]["split"] == "stage1"
    assert (data[steps[3][0]].input_ids == then[steps[3][0] - len(first)].input_ids).all()
    train(tiny_model(), data, RunParams(steps=5, micro_batch=2, lr=1e-3, warmup=0.0), tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["tokens"] for r in rows] == [2 * first.seq_len] * 3 + [2 * then.seq_len] * 2
    assert [r["lr"] for r in rows] == sorted((r["lr"] for r in rows), reverse=True)  # one decay throughout


def test_progress_lines_where_no_terminal_watches(small_project, tmp_path, monkeypatch, capsys):
    """Through a pipe (the flow's log) a bar shows nothing until it closes: a line per interval
    instead, with the step, loss, tokens/s and ETA, and a last line with the final count; resumed,
    the count starts at the checkpoint."""
    monkeypatch.setenv("LONGCTX_PROGRESS_SECONDS", "0")
    data = PackedDataset(small_project / "data/packed/stage1/train")
    cfg = RunParams(steps=4, lr=1e-3, checkpoint_every=2)
    train(tiny_model(), data, cfg.model_copy(update={"steps": 2}), tmp_path)
    capsys.readouterr()
    train(tiny_model(), data, cfg, tmp_path)
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("train: ")]
    assert [x.split(",")[0] for x in lines] == ["train: 3/4 step (75.0%)", "train: 4/4 step (100.0%)"]
    losses = read_losses(tmp_path / "metrics.jsonl")
    assert f"loss={losses[2]:.4f}" in lines[0] and "tokens_per_s=" in lines[0] and "eta " in lines[0]
    assert "eta" not in lines[-1] and "elapsed " in lines[-1]


def test_progress_lines_keep_to_their_interval(monkeypatch, capsys):
    from longctx import progress

    clock = iter([0.0, 10.0, 29.0, 31.0, 45.0, 55.0, 70.0])
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    bar = progress.Lines(total=5, desc="rope_search", unit="gen")  # started at 0 s
    for _ in range(5):  # updates at 10, 29, 31, 45 and 55 s
        bar.update(1)
    bar.close()  # at 70 s: 5 is not yet written
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["rope_search: 3/5 gen (60.0%), 0.10 gen/s, elapsed 0:31, eta 0:20",
                     "rope_search: 5/5 gen (100.0%), 0.07 gen/s, elapsed 1:10"]


def test_a_metrics_line_torn_by_a_kill_does_not_block_the_resume(small_project, tmp_path):
    data = PackedDataset(small_project / "data/packed/stage1/train")
    cfg = RunParams(steps=4, lr=1e-3, checkpoint_every=2)
    train(tiny_model(), data, cfg.model_copy(update={"steps": 2}), tmp_path)
    log = tmp_path / "metrics.jsonl"
    with log.open("a") as fh:
        fh.write('{"step": 3, "loss": 5.1')  # killed mid-write
    train(tiny_model(), data, cfg, tmp_path)
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2, 3, 4]
