"""Bad input and faults against the real stages (issue 19's catalogue), each held to one
contract: the documented exit code (2), a one-line message naming the file, key or value, no
traceback, nothing of the project changed, and an answer within seconds (a full or read-only
disk in a private mount namespace). Then: what a killed run leaves behind is cleared by the next
one, and never another live run's work; `dvc repro` after a SIGKILL, and beside another repro;
training stages killed three times each resume bitwise; the main command names a failing stage;
a tracking server that dies mid-stage costs the stage nothing."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from conftest import REPO, SMALL, copy_workspace, dvc_workspace, sh, stage_env, stage_process, write_params
from longctx.config import merge
from longctx.io import atomic_dir, clear_stale


@dataclass(frozen=True)
class Case:
    stage: str
    params: dict
    """Overrides of the small project's params (SMALL)."""
    message: str
    """A regular expression the error line matches."""
    setup: Callable[[Path], None] | None = None
    """Breaks something in the project before the stage runs."""
    env: dict[str, str] = field(default_factory=dict)
    mounts: str | None = None
    """Shell run first in a private mount namespace (a full or read-only disk for this stage only)."""
    logs_steps: bool = False
    """It fails mid-training: the run folder (runs/, scratch, not an output) keeps the steps logged."""


def _write(name: str, text: str) -> Callable[[Path], None]:
    return lambda project: (project / name).write_text(text)


def _parquet_cut_in_half(project: Path) -> None:
    table = pa.table({"text": [f"document {i}: " + "words " * 200 for i in range(200)]})
    pq.write_table(table, project / "books.parquet")
    data = (project / "books.parquet").read_bytes()
    (project / "books.parquet").write_bytes(data[: len(data) // 2])  # a half-downloaded file


def _tokenizer(change: Callable[[Path], None]) -> Callable[[Path], None]:
    return lambda project: change(project / "data/tokens/tokenizer")


def _base(vocab: int | None = None, tokenizer: str | None = None, tensors_of: dict | None = None,
          cut: bool = False, flip: bool = False, digests: bool = True) -> Callable[[Path], None]:
    """Writes models/base as the base stage would (a random model of the params' shape, its
    summary naming the tokenizer), then breaks it: another vocabulary or tokenizer, the tensors
    of another shape (`tensors_of`: model params), the weights file cut in half, or 64 KiB of it
    inverted in place (`flip`: it still parses). `digests=False`: its config without the weights'
    digests, as a checkpoint assembled by hand (or saved before they were recorded)."""
    def setup(project: Path) -> None:
        from longctx.config import load
        from longctx.train.models import base_model, save_model

        model_params = load(project / "params.yaml").model
        index = json.loads((project / "data/tokens/index.json").read_text())
        folder = project / "models/base"
        save_model(base_model(model_params, vocab or index["vocab_size"], 0), folder, None)
        (folder / "summary.json").write_text(json.dumps({"tokenizer": tokenizer or index["fingerprint"]}))
        weights = folder / "model.safetensors"
        if tensors_of is not None:
            other = project / "other"
            save_model(base_model(model_params.model_copy(update=tensors_of), index["vocab_size"], 0), other, None)
            shutil.copy(other / "model.safetensors", weights)
            shutil.rmtree(other)
        if cut:
            weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        if flip:
            data = bytearray(weights.read_bytes())
            middle = len(data) // 2
            data[middle:middle + 65536] = bytes(b ^ 0xFF for b in data[middle:middle + 65536])
            weights.write_bytes(bytes(data))
        if not digests:
            config = json.loads((folder / "longctx_config.json").read_text())
            del config["weights"]
            (folder / "longctx_config.json").write_text(json.dumps(config))
    return setup


def _base_config_stray_comma(project: Path) -> None:
    _base()(project)
    path = project / "models/base/longctx_config.json"
    path.write_text(path.read_text().replace("{", "{,", 1))


def _tokens_rewritten(fill: str) -> Callable[[Path], None]:
    """The base split's tokens.bin rewritten in place at its size: zeros, or random token ids."""
    def setup(project: Path) -> None:
        path = project / "data/packed/base/train/tokens.bin"
        size = path.stat().st_size
        path.write_bytes(bytes(size) if fill == "zeros" else random.Random(7).randbytes(size))
    return setup


def _short_books(project: Path) -> None:
    """Every document of the long domain books cut to one sentence (the corpora stage's output)."""
    path = project / "data/corpora/books.parquet"
    table = pq.read_table(path)
    pq.write_table(table.set_column(table.schema.get_field_index("text"), "text",
                                    pa.array(["A book of one sentence."] * table.num_rows)), path)


def _every_checkpoint(project: Path) -> None:
    _base()(project)
    for name in ("pretrain/stage1", "pretrain/stage2", "sft"):
        shutil.copytree(project / "models/base", project / "models" / name)


def _tokenizer_swapped(project: Path) -> None:
    """Every checkpoint written, then data/tokens/tokenizer replaced by another (its chat template
    changed: a tokenizer of another fingerprint) after the tokens were made."""
    from longctx.data.tokenizer import TextTokenizer

    _every_checkpoint(project)
    folder = project / "data/tokens/tokenizer"
    (folder / "chat_template.jinja").write_text(TextTokenizer.load(folder).chat_template + "{# another #}")


def _factors(long: list) -> Callable[[Path], None]:
    return lambda project: (_base()(project), (project / "factors.json").write_text(
        json.dumps({"long_factor": long, "original_max_position_embeddings": 256})))


FROM_BASE = {"train": {"base": None, "pretrain": {"init": "models/base"}}}
"""Pretraining from a checkpoint the test writes (no base stage run)."""
FACTORS = merge(FROM_BASE, {"train": {"pretrain": {"factors": "factors.json"}}})
BIND_DATA = ("mount --bind data/{0} .in && mount -t tmpfs -o size={1} tmpfs data && mkdir data/{0} && "
             "mount --bind .in data/{0}")
"""data/ on a tmpfs of that size, the stage's input folder (bound to .in first) still readable in it."""
READ_ONLY = "mount --bind {0} {0} && mount -o remount,bind,ro {0}"


@functools.cache
def _private_mounts() -> bool:
    """Whether this machine lets a process mount a tmpfs in a namespace of its own (the disk cases)."""
    if shutil.which("unshare") is None:
        return False
    probe = ["unshare", "--map-root-user", "--mount", "sh", "-c", "mount -t tmpfs -o size=4k tmpfs /tmp"]
    return subprocess.run(probe, capture_output=True).returncode == 0


def _folder(name: str) -> Callable[[Path], None]:
    return lambda project: (project / name).mkdir(exist_ok=True)


CASES = {
    "typo_key": Case("pack", {"pack": {"seeed": 1}}, r"pack\.seeed: unknown key"),
    "shares_099": Case("pack", {"pack": {"groups": {"shortmix": {"docstrings": 0.59}}}},
                       r"pack\.groups\.shortmix: shares sum to 0\.99, must sum to 1"),
    "shares_12": Case("pack", {"pack": {"groups": {"shortmix": {"docstrings": 0.8}}}},
                      r"pack\.groups\.shortmix: shares sum to 1\.2, must sum to 1"),
    "negative_length": Case("pack", {"pack": {"splits": {"stage1": {"seq_len": -512}}}},
                            r"pack\.splits\.stage1\.seq_len: .*greater than 0"),
    "zero_length": Case("pack", {"pack": {"splits": {"stage1": {"seq_len": 0}}}},
                        r"pack\.splits\.stage1\.seq_len: .*greater than 0"),
    "string_length": Case("pack", {"pack": {"splits": {"stage1": {"seq_len": "long"}}}},
                          r"pack\.splits\.stage1\.seq_len: .*integer"),
    "base_split_past_the_window": Case("pack", {"pack": {"splits": {"base": {"seq_len": 262144}}}},
                                       r"pack\.splits\.base\.seq_len: 262144 is beyond the base model's window "
                                       r"\(model\.max_position_embeddings 256\)"),
    "rope_target_in_window": Case("rope_search", {"rope_search": {"target_length": 256, "original_window": 256}},
                                  r"rope_search\.target_length: 256 must exceed the original window 256"),
    "typo_key_under_dvc": Case("pack", {"pack": {"seeed": 1}}, r"pack\.seeed: unknown key.*DVC removed this stage's "
                               r"earlier outputs before it ran: `dvc checkout pack` restores them\)$",
                               env={"DVC_STAGE": "pack"}),
    "unknown_backend": Case("base", {"model": {"attention_backend": "flashy"}},
                            r"model\.attention_backend: attention backend 'flashy' is unknown"),
    "backend_not_on_this_machine": Case("base", {"model": {"attention_backend": "cudnn"}},
                                        r"model\.attention_backend: attention backend 'cudnn' cannot run on cpu"),
    "odd_head_dim_with_rope": Case("base", {"model": {"d_model": 36, "n_heads": 4}},
                                   r"model: RoPE needs an even head_dim"),
    "head_dim_the_backend_refuses": Case("base", {"model": {"attention_backend": "fox", "d_model": 48}},
                                         r"attention backend 'fox' takes a power-of-two head_dim .*heads have 12"),
    "sequence_parallel_over_ranks": Case("base", {"train": {"base": {"sequence_parallel": 2}}},
                                         r"train\.base\.sequence_parallel: 2 does not divide the world size 1"),
    "sequence_parallel_over_heads": Case("base", {"train": {"nproc": 3, "base": {"sequence_parallel": 3}}},
                                         r"train\.base\.sequence_parallel: 3 does not divide the model's 4 "
                                         r"attention heads"),
    "mlflow_unreachable": Case("pack", {}, r"tracking\.uri: the MLflow server at http://127\.0\.0\.1:9 does not "
                               r"answer \(.*refused\).*tracking\.unreachable: local",
                               env={"MLFLOW_TRACKING_URI": "http://127.0.0.1:9"}),
    "unknown_profile": Case("pack", {"profile": "huge"}, r"profile: unknown profile 'huge'"),
    "invalid_yaml": Case("pack", {}, r"params\.yaml:3:10: not valid YAML: mapping values are not allowed here",
                         setup=_write("params.yaml", "profile: tiny\npack:\n  seed: a: b\n")),
    "truncated_parquet": Case("corpora", {"corpora": {"domains": {"books": {"sources": [{"path": "books.parquet"}]}}}},
                              r"books\.parquet: corrupt or unreadable parquet", setup=_parquet_cut_in_half),
    "malformed_jsonl_line": Case("corpora", {"corpora": {"domains": {"books": {"sources": [{"path": "books.jsonl"}]}}}},
                                 r"books\.jsonl:2: corrupt JSON line",
                                 setup=_write("books.jsonl", '{"text": "one"}\n{"text": two}\n')),
    "empty_corpus": Case("corpora", {"corpora": {"domains": {"books": {"sources": [{"path": "books.jsonl"}]}}}},
                         r"corpora\.domains\.books: source path books\.jsonl yielded no documents",
                         setup=_write("books.jsonl", "\n")),
    "hub_dataset_missing": Case("corpora", {"corpora": {"domains": {"books": {"sources": [
                                    {"hub": "no-such-org/no-such-dataset"}]}}}},
                                r"hub source 'no-such-org/no-such-dataset'"),
    "tokenizer_without_vocabulary": Case("pack", {}, r"data/tokens/tokenizer.*tokenizer\.json",
                                         setup=_tokenizer(lambda t: (t / "tokenizer.json").unlink())),
    "corrupt_tokenizer": Case("pack", {}, r"data/tokens/tokenizer.*tokenizer\.json",
                              setup=_tokenizer(lambda t: (t / "tokenizer.json").write_text('{"model": {"vocab'))),
    "checkpoint_wrong_shapes": Case("pretrain", FROM_BASE, r"models/base: tensor .* has shape \(1024, 48\)",
                                    setup=_base(tensors_of={"d_model": 48}, digests=False)),
    "corrupt_mlflow_store": Case("pack", {}, r"mlflow\.db: not an MLflow store \(file is not a database\); move it "
                                 r"aside .* or set tracking\.enabled: false",
                                 setup=_write("mlflow.db", "not sqlite " * 200), env={"MLFLOW_TRACKING_URI": ""}),
    "packed_tokens_zeroed": Case("base", {}, r"data/packed/base/train/tokens\.bin: its contents are not what the "
                                 r"pack stage wrote", setup=_tokens_rewritten("zeros")),
    "packed_tokens_random": Case("base", {}, r"data/packed/base/train/tokens\.bin: its contents are not what the "
                                 r"pack stage wrote", setup=_tokens_rewritten("random")),
    "checkpoint_config_stray_comma": Case("pretrain", FROM_BASE, r"models/base/longctx_config\.json: the "
                                          r"checkpoint's config is corrupt: Expecting property name",
                                          setup=_base_config_stray_comma),
    "checkpoint_truncated": Case("pretrain", FROM_BASE, r"models/base/model\.safetensors: is [\d,]+ bytes, [\d,]+ "
                                 r"were saved: the file is corrupt or was replaced", setup=_base(cut=True)),
    "checkpoint_truncated_without_digests": Case("pretrain", FROM_BASE, r"models/base/model\.safetensors: "
                                                 r"unreadable safetensors", setup=_base(cut=True, digests=False)),
    "tokenizer_swapped_before_sft": Case("sft", FROM_BASE, r"data/tokens/tokenizer: changed since tokenize ran "
                                         r"\(fingerprint [0-9a-f]{16}, the tokens were made with [0-9a-f]{16}\)",
                                         setup=_tokenizer_swapped),
    "tokenizer_swapped_before_eval": Case("eval", FROM_BASE, r"data/tokens/tokenizer: changed since tokenize ran",
                                          setup=_tokenizer_swapped),
    "checkpoint_bytes_flipped": Case("rope_search", FROM_BASE, r"models/base/model\.safetensors: its SHA-256 is "
                                     r"[0-9a-f]{12}\.\.\., [0-9a-f]{12}\.\.\. was saved: the file is corrupt",
                                     setup=_base(flip=True)),
    "checkpoint_of_another_tokenizer": Case("pretrain", FROM_BASE,
                                            r"models/base: trained on tokens of tokenizer 0123456789abcdef.*"
                                            r"the tokenizer does not match the checkpoint",
                                            setup=_base(tokenizer="0123456789abcdef")),
    "checkpoint_vocabulary_too_small": Case("pretrain", FROM_BASE, r"models/base: its vocabulary has 512 tokens, "
                                            r"data/tokens has ids up to 1024", setup=_base(vocab=512)),
    "factors_wrong_length": Case("pretrain", FACTORS, r"factors\.json: long_factor must be a list of 4 numbers",
                                 setup=_factors([1.0, 2.0, 3.0])),
    "factors_not_monotone": Case("pretrain", FACTORS, r"factors\.json: long_factor\[2\] = 1\.5 is below "
                                 r"long_factor\[1\] = 2\.0", setup=_factors([1.0, 2.0, 1.5, 3.0])),
    "factors_nan": Case("pretrain", FACTORS, r"factors\.json: long_factor\.1: .*finite",
                        setup=_factors([1.0, float("nan"), 2.0, 3.0])),
    "eval_lengths_past_every_window": Case("eval", {"eval": {"lengths": [256, 100000]}},
                                           r"eval\.lengths: \[100000\] exceed every checkpoint's window "
                                           r"\(the longest is 256\)", setup=_every_checkpoint),
    "eval_length_too_short": Case("eval", {"eval": {"lengths": [16]}},
                                  r"eval\.lengths: 16 tokens cannot hold a \w+ prompt: its question, needles and "
                                  r"answer prefix take \d+ tokens", setup=_every_checkpoint),
    "no_long_documents": Case("tokenize", {}, r"data/corpora/books\.parquet: domain 'books' kept no documents: none of "
                              r"its 28 documents has >= 512 tokens \(the longest has \d+\)", setup=_short_books),
    "nan_loss": Case("base", {"train": {"base": {"lr": 1e30}}},
                     r"step \d+: (loss|gradient norm) is (nan|inf); no checkpoint .*documents", logs_steps=True),
    "disk_full_before_packing": Case("pack", {}, r"data/packed: .* free, about .* needed for the packed splits",
                                     setup=_folder(".in"), mounts=BIND_DATA.format("tokens", "64k")),
    "disk_full_while_tokenizing": Case("tokenize", {}, r"data/.*No space left on device; outputs from before",
                                       setup=_folder(".in"), mounts=BIND_DATA.format("corpora", "256k")),
    "read_only_models": Case("base", {}, r"models/base: cannot write the base stage's outputs there "
                             r"\(Read-only file system\)", setup=_folder("models"),
                             mounts=READ_ONLY.format("models")),
    "read_only_data": Case("pack", {}, r"data/packed: cannot write the pack stage's outputs there "
                           r"\(Read-only file system\)", mounts=READ_ONLY.format("data")),
    "read_only_artifacts": Case("pack", {}, r"/mlartifacts: cannot write the MLflow store's files there \(Read-only "
                                r"file system\); or set tracking.enabled: false", setup=_folder("mlartifacts"),
                                mounts=READ_ONLY.format("mlartifacts")),
}


def test_an_unreachable_tracking_server_can_fall_back_to_the_local_store(project_copy):
    from mlflow.tracking import MlflowClient

    local = f"sqlite:///{(project_copy / 'mlflow.db').resolve()}"

    def pack_runs() -> int:
        client = MlflowClient(local)
        runs = client.search_runs([client.get_experiment_by_name("longctx").experiment_id])
        return sum(r.info.run_name == "pack" for r in runs)

    before = pack_runs()
    params = merge(SMALL, {"tracking": {"unreachable": "local"}})
    done = stage_process(project_copy, "pack", params, {"MLFLOW_TRACKING_URI": "http://127.0.0.1:9"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "tracking: http://127.0.0.1:9 does not answer" in done.stderr and f"recording in {local}" in done.stderr
    assert pack_runs() == before + 1


def test_a_stage_failing_after_it_replaced_an_output_says_so(project_copy):
    """metrics/ full (a filled tmpfs) takes the start's probe but not pack.json, written after
    data/packed was replaced: the line names what this run replaced, not "intact" (issue 63)."""
    if not _private_mounts():
        pytest.skip("this machine gives no private mount namespace (unshare): no tmpfs")
    write_params(project_copy, SMALL)
    done = stage_process(project_copy, "pack", None, None,
                         "mount -t tmpfs -o size=8k tmpfs metrics && { cat /dev/zero > metrics/fill || true; }")
    errors = [line for line in done.stderr.splitlines() if line.startswith("pack: error: ")]
    assert done.returncode == 2 and len(errors) == 1, done.stderr[-2000:]
    assert re.search(r"metrics/.*No space left on device; this run had already replaced data/packed \(its other "
                     r"outputs are from before it\): rerun the stage$", errors[0]), errors[0]
    assert "Traceback" not in done.stderr


def test_a_store_whose_disk_fills_mid_training_costs_the_stage_nothing(project_copy):
    """Issue 63: the SQLite store on a disk that fills while the base stage trains (a tmpfs in a
    private mount namespace, filled once 20 steps are logged): one line says recording stopped,
    training finishes and writes its outputs, exit 0; once the disk has room again the next stage
    that records ends the run the full disk left RUNNING."""
    if not _private_mounts():
        pytest.skip("this machine gives no private mount namespace (unshare): no tmpfs")
    from mlflow.tracking import MlflowClient

    (project_copy / "store").mkdir()
    uri = f"sqlite:///{project_copy / 'store' / 'mlflow.db'}"
    write_params(project_copy, merge(SMALL, {"tracking": {"uri": uri},
                                             "train": {"base": {"steps": 300, "checkpoint_every": 300}}}))
    script = ('mount -t tmpfs -o size=64m tmpfs store && { "$@" -m stages.base > base.out 2> base.err & } && '
              'until [ "$(cat runs/base/*/metrics.jsonl 2>/dev/null | wc -l)" -ge 20 ] || ! kill -0 $! 2>/dev/null; '
              'do sleep 0.05; done; cat /dev/zero > store/fill 2>/dev/null; wait $!; echo $? > base.code; '
              'rm store/fill; "$@" -m stages.pack > pack.out 2> pack.err; echo $? > pack.code; '
              'cp store/mlflow.db kept.db')
    subprocess.run(["unshare", "--map-root-user", "--mount", "sh", "-c", script, "sh", sys.executable],
                   cwd=project_copy, env=stage_env(), timeout=600, check=True)
    err = (project_copy / "base.err").read_text()
    assert (project_copy / "base.code").read_text().strip() == "0", err[-2000:]
    said = [line for line in err.splitlines() if line.startswith("tracking: ")]
    assert len(said) == 1 and "stopped taking writes (" in said[0] and "disk is full" in said[0], err[-2000:]
    assert "Traceback" not in err
    steps = (next((project_copy / "runs" / "base").glob("*/metrics.jsonl"))).read_text().splitlines()
    assert len(steps) == 300 and (project_copy / "models/base/model.safetensors").is_file()
    assert (project_copy / "pack.code").read_text().strip() == "0", (project_copy / "pack.err").read_text()[-2000:]
    client = MlflowClient(f"sqlite:///{project_copy / 'kept.db'}")
    runs = {r.info.run_name: r for r in client.search_runs([client.get_experiment_by_name("longctx").experiment_id])}
    assert runs["pack"].info.status == "FINISHED" and runs["base"].info.status == "FAILED"
    assert "had ended without ending the run" in runs["base"].data.tags["longctx.ended_by"]
    history = client.get_metric_history(runs["base"].info.run_id, "train/loss")
    assert 1 <= len(history) < 300  # the steps recorded before the disk filled


def _tree(project: Path) -> dict[str, str]:
    """Every file and folder of the project but the tracking store (a failed run is recorded)."""
    return {str(p.relative_to(project)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(project.rglob("*")) if not p.relative_to(project).parts[0].startswith(("mlflow", "mlart"))}


def _run_case(project: Path, case: Case) -> tuple[subprocess.CompletedProcess, dict[str, str], float]:
    """Runs the case; returns the stage's process, the project's tree just before it, and its seconds."""
    write_params(project, merge(SMALL, case.params))
    if case.setup is not None:
        case.setup(project)
    before = _tree(project)
    start = time.perf_counter()
    done = stage_process(project, case.stage, None, case.env, case.mounts)
    return done, before, time.perf_counter() - start


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_fails_fast_with_one_clear_line_and_changes_nothing(name, project_copy):
    case = CASES[name]
    if case.mounts and not _private_mounts():
        pytest.skip("this machine gives no private mount namespace (unshare): no tmpfs or read-only mount")
    done, before, seconds = _run_case(project_copy, case)
    assert done.returncode == 2, done.stdout[-1500:] + done.stderr[-1500:]
    errors = [line for line in done.stderr.splitlines() if line.startswith(f"{case.stage}: error: ")]
    assert len(errors) == 1 and re.search(case.message, errors[0]), done.stderr[-1500:]
    assert "Traceback" not in done.stdout + done.stderr
    after = _tree(project_copy)
    if case.logs_steps:
        after = {k: v for k, v in after.items() if not k.startswith("runs")}
    assert after == before
    assert seconds < 30


def _dead_pid() -> int:
    """The pid of a process that has exited."""
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)


def test_a_killed_runs_temporaries_go_and_a_live_runs_stay(tmp_path):
    host, dead = socket.gethostname(), _dead_pid()
    stale = tmp_path / f".packed.tmp-{host}-{dead}-k3j2"
    stale.mkdir()
    (stale / "tokens.bin").write_bytes(b"\0" * 1024)
    old = tmp_path / f".packed.old-{host}-{dead}"
    old.mkdir()
    kept = [tmp_path / f".packed.tmp-{host}-{os.getpid()}-live",  # a run still writing
            tmp_path / f".packed.tmp-otherhost-{dead}-x9",  # another host's, on a shared disk
            tmp_path / f".tokens.tmp-{host}-{dead}-a1",  # another output's
            tmp_path / "packed-notes"]
    for path in kept:
        path.mkdir()
    with atomic_dir(tmp_path / "packed") as tmp:
        (tmp / "index.json").write_text("{}")
    assert not stale.exists() and not old.exists()
    assert all(path.exists() for path in kept)
    assert (tmp_path / "packed/index.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*(p.name for p in kept), "packed"])
    # without a name, every output's stale temporaries go (a checkpoint folder at a run's start)
    assert clear_stale(tmp_path) == [tmp_path / f".tokens.tmp-{host}-{dead}-a1"]


def test_outputs_follow_the_umask(tmp_path):
    """Under umask 022 an output folder is 0755 and its weights 0644 (mkdtemp's 0700 and safetensors'
    0600 had kept other users, and a container of another UID, out of every model); under 077 both
    stay private."""
    from longctx.io import safetensors_file, umask

    old = os.umask(0o022)
    try:
        for mask, folder_mode, file_mode in ((0o022, 0o755, 0o644), (0o077, 0o700, 0o600)):
            os.umask(mask)
            assert umask() == mask
            with atomic_dir(tmp_path / f"model-{mask:o}") as tmp:
                safetensors_file({"w": torch.zeros(2)}, tmp / "model.safetensors")
                (tmp / "config.json").write_text("{}")
            out = tmp_path / f"model-{mask:o}"
            modes = {p.name: p.stat().st_mode & 0o777 for p in (out, *out.iterdir())}
            assert modes == {out.name: folder_mode, "model.safetensors": file_mode, "config.json": file_mode}
    finally:
        os.umask(old)


def test_the_space_pack_asks_for_bounds_what_it_writes(small_project):
    from longctx.config import load
    from longctx.data.pack import estimated_bytes

    cfg = load(small_project / "params.yaml")
    need = estimated_bytes(cfg, json.loads((small_project / "data/tokens/index.json").read_text()))
    written = sum(f.stat().st_size for f in (small_project / "data/packed").rglob("*")
                  if f.name in ("tokens.bin", "loss_mask.bin"))
    assert written <= need <= 1.5 * written


def _killed_when(proc: subprocess.Popen, ready: Callable[[], bool], deadline_s: float = 300) -> None:
    """SIGKILL the process group of `proc` (dvc and the stage under it) once `ready()` holds."""
    deadline = time.time() + deadline_s
    while not ready() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, "the stage finished before it was killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _writing(ws: Path, output: str) -> Callable[[], bool]:
    """True once a new temporary of the stage's output (not one there now) holds a file of some
    size: the stage is mid-write."""
    old = set((ws / "data").glob(f".{output}.tmp-*"))
    return lambda: any(f.is_file() and f.stat().st_size > 0
                       for tmp in set((ws / "data").glob(f".{output}.tmp-*")) - old for f in tmp.rglob("*"))


@pytest.mark.slow
def test_dvc_repro_after_a_kill_and_beside_another_repro(tmp_path):
    """SIGKILL mid-write in tokenize and in pack: nothing half-written is taken for an output, and
    `dvc repro` reruns the stage whole (its temporaries cleared). A second `dvc repro` in the same
    workspace while one trains is refused at once by DVC's lock and harms nothing."""
    ws = tmp_path / "ws"
    env = dvc_workspace(ws, merge(SMALL, {"train": {"base": {"steps": 800, "checkpoint_every": 400}}}))  # ~10 s
    sh(["dvc", "repro", "corpora"], ws, env)
    for stage, output in (("tokenize", "tokens"), ("pack", "packed")):
        writing = _writing(ws, output)
        proc = subprocess.Popen(["dvc", "repro", stage], cwd=ws, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        _killed_when(proc, writing)
        assert not (ws / "data" / output).exists() and list((ws / "data").glob(f".{output}.tmp-*"))
        assert stage in sh(["dvc", "status", stage], ws, env)
        sh(["dvc", "repro", stage], ws, env)
        assert not list((ws / "data").glob(f".{output}.*")), "the killed run's temporaries are left"
        assert "Data and pipelines are up to date" in sh(["dvc", "status", stage], ws, env)
    manifest = json.loads((ws / "data/packed/manifest.json").read_text())
    for split in manifest["splits"]:
        for part in ("train", "val"):
            index = json.loads((ws / f"data/packed/{split}/{part}/index.json").read_text())
            size = (ws / f"data/packed/{split}/{part}/tokens.bin").stat().st_size
            assert size == index["sequences"] * index["seq_len"] * 2  # uint16 ids: every sequence whole

    log = tmp_path / "first.log"  # (a pipe nobody reads would fill and stop it)
    with log.open("w") as out:
        first = subprocess.Popen(["dvc", "repro", "base"], cwd=ws, env=env, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    deadline = time.time() + 300
    while _steps_logged(ws, "base") < 1 and first.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert first.poll() is None, log.read_text()[-3000:]
    start = time.perf_counter()
    second = subprocess.run(["dvc", "repro", "base"], cwd=ws, env=env, capture_output=True, text=True, timeout=60)
    assert time.perf_counter() - start < 30
    assert second.returncode != 0 and re.search(rf"is busy, it is being blocked by:\n +\(PID {first.pid}\): "
                                                r".*dvc repro base", second.stderr), second.stderr
    assert first.wait(timeout=600) == 0, log.read_text()[-2000:]
    assert _steps_logged(ws, "base") == 800
    assert "Data and pipelines are up to date" in sh(["dvc", "status", "base"], ws, env)


@pytest.mark.slow
def test_the_main_command_names_the_failing_stage_and_how_to_rerun(tmp_path):
    ws = tmp_path / "ws"
    env = dvc_workspace(ws, merge(SMALL, {"corpora": {"domains": {"books": {"sources": [{"path": "no-books"}]}}}}))
    done = subprocess.run([sys.executable, "-m", "pipelines", str(ws)], cwd=ws, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 1
    assert "Traceback" not in done.stdout + done.stderr
    tail = done.stderr[done.stderr.index("longctx pipeline: "):]
    assert re.search(r"longctx pipeline: stage corpora failed .*\ncorpora: error: no-books: source path does not "
                     r"exist.*\n(.*\n)*fix that, then rerun the pipeline .* dvc repro corpora", tail), tail
    assert not (ws / "data" / "corpora").exists()


def test_the_main_command_refuses_bad_params_and_a_busy_workspace_in_one_line(tmp_path):
    """Before Prefect starts: a params error, or another pipeline run holding the workspace, is one
    line and exit 2 (not the message inside two tracebacks)."""
    import fcntl

    ws = tmp_path / "ws"
    env = dvc_workspace(ws, merge(SMALL, {"pack": {"seeed": 1}}))
    main = [sys.executable, "-m", "pipelines", str(ws)]
    done = subprocess.run(main, cwd=ws, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert re.fullmatch(r"longctx pipeline: .*params\.yaml: pack\.seeed: unknown key.*", done.stderr.strip())
    write_params(ws, SMALL)
    lock = ws / ".dvc/tmp/longctx-pipeline.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        fh.write("flow run busy-bee (pid 1)\n")
        fh.flush()
        done = subprocess.run(main, cwd=ws, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip() == (f"longctx pipeline: {ws}: another longctx pipeline run holds this workspace "
                                   "(flow run busy-bee (pid 1)); wait for it or use another clone")
    assert not (ws / "data").exists()


def test_the_main_command_refuses_stores_and_prefect_apis_that_cannot_take_the_run(tmp_path):
    """Before anything runs, one line and exit 2 each: an MLflow server that does not answer, a
    junk mlflow.db (left as it was), a PREFECT_API_URL where nothing listens, and one that is
    another kind of server (a plain HTTP file server)."""
    ws = tmp_path / "ws"
    env = dvc_workspace(ws, SMALL)
    main = [sys.executable, "-m", "pipelines", str(ws)]

    def refused(extra: dict[str, str]) -> str:
        done = subprocess.run(main, cwd=ws, env={**env, **extra}, capture_output=True, text=True, timeout=300)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
        return done.stderr.strip()

    said = refused({"MLFLOW_TRACKING_URI": "http://127.0.0.1:9"})
    assert said.startswith("longctx pipeline: tracking.uri: the MLflow server at http://127.0.0.1:9 does not answer")
    junk = b"not a database at all " * 64
    (ws / "mlflow.db").write_bytes(junk)
    assert refused({}) == (f"longctx pipeline: {ws / 'mlflow.db'}: not an MLflow store (file is not a database); "
                           "move it aside (a new one is made) or set tracking.enabled: false")
    assert (ws / "mlflow.db").read_bytes() == junk
    (ws / "mlflow.db").unlink()
    said = refused({"PREFECT_API_URL": "http://127.0.0.1:9/api"})
    assert said.startswith("longctx pipeline: PREFECT_API_URL=http://127.0.0.1:9/api: no Prefect server answers "
                           "there (") and "unset PREFECT_API_URL" in said, said
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    files = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"], cwd=tmp_path,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        said = refused({"PREFECT_API_URL": f"http://127.0.0.1:{port}/api"})
    finally:
        files.terminate()
        files.wait()
    assert said.startswith(f"longctx pipeline: PREFECT_API_URL=http://127.0.0.1:{port}/api: the server there is "
                           "not a Prefect API (GET /health: HTTP 404"), said
    assert not (ws / "data").exists() and not (ws / "mlflow.db").exists()


def test_the_main_command_line_takes_help_a_workspace_and_gpus(capsys, tmp_path):
    """`--help` is help, not a workspace path; a second path or a bad --gpus is a usage error (exit 2)."""
    from pipelines.__main__ import arguments

    with pytest.raises(SystemExit) as done:
        arguments(["--help"])
    assert done.value.code == 0 and "--gpus IDS" in capsys.readouterr().out
    args = arguments([str(tmp_path), "--gpus", "0, 1"])
    assert args.workspace == tmp_path and args.gpus == "0, 1"
    for wrong, said in (([str(tmp_path), "extra"], "unrecognized arguments: extra"),
                        (["--gpus", "cuda:0"], "--gpus: 'cuda:0' is not a comma-separated list")):
        with pytest.raises(SystemExit) as done:
            arguments(wrong)
        assert done.value.code == 2 and said in capsys.readouterr().err


def test_the_main_command_says_git_init_where_there_is_no_repository(tmp_path):
    """A downloaded archive (no .git): refused before the run, with what to do; a git work tree,
    or DVC set to run without git, passes."""
    from longctx.errors import LongctxError
    from pipelines.__main__ import versioned

    with pytest.raises(LongctxError, match=r"not a git repository, which DVC runs in: `git init && git add -A"):
        versioned(tmp_path)
    (tmp_path / ".dvc").mkdir()
    (tmp_path / ".dvc/config").write_text("[core]\n    no_scm = True\n")
    versioned(tmp_path)
    repo = tmp_path / "repo"
    repo.mkdir()
    sh(["git", "init", "-q"], repo, dict(os.environ))
    versioned(repo)


def test_ctrl_c_while_the_main_command_imports_is_one_line(tmp_path):
    """SIGINT once the imports are under way (pydantic's compiled core mapped, Prefect still to
    come): exit 130 and one line, no KeyboardInterrupt traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "pipelines", str(tmp_path)], cwd=REPO, stderr=subprocess.PIPE,
                            text=True)
    maps = Path(f"/proc/{proc.pid}/maps")
    deadline = time.monotonic() + 60
    while "pydantic_core" not in maps.read_text() and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err.strip() == "longctx pipeline: interrupted while starting; nothing ran", err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_the_main_command_refuses_gpus_a_machine_without_cuda_lacks(monkeypatch):
    from longctx.errors import LongctxError
    from pipelines.__main__ import gpus_present

    monkeypatch.delenv("LONGCTX_GPUS", raising=False)
    gpus_present()
    monkeypatch.setenv("LONGCTX_GPUS", "0,1")
    with pytest.raises(LongctxError, match=r"LONGCTX_GPUS=0,1 names GPUs, but this machine has no CUDA device"):
        gpus_present()


@pytest.mark.parametrize("stage", ["eval", "tokenize"])
def test_a_stage_run_as_a_script_says_how_to_run_it(stage):
    """`python stages/eval.py` puts stages/ first on sys.path, where tokenize.py shadows Python's
    own (a circular-import traceback): one line naming the command instead."""
    done = subprocess.run([sys.executable, f"stages/{stage}.py"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.strip() == f"run it as `python -m stages.{stage}` from the project root (or `dvc repro {stage}`)"


RESUMABLE = merge(SMALL, {"train": {
    "base": {"steps": 10, "checkpoint_every": 2},
    "pretrain": {"stages": [{**s, "steps": 6, "checkpoint_every": 2} for s in SMALL["train"]["pretrain"]["stages"]]},
    "sft": {"steps": 6, "checkpoint_every": 2},
}})


def _steps_logged(project: Path, stage: str) -> int:
    return sum(len(f.read_text().splitlines()) for f in (project / "runs").glob(f"{stage}*/*/metrics.jsonl"))


def _losses(project: Path) -> dict[str, list[float]]:
    return {f.parent.parent.name: [json.loads(line)["loss"] for line in f.read_text().splitlines()]
            for f in sorted((project / "runs").glob("*/*/metrics.jsonl"))}


@pytest.mark.slow
def test_training_stages_killed_three_times_each_resume_bitwise(small_project, tmp_path):
    """base, pretrain (both curriculum stages) and sft, each SIGKILLed at three random points of
    its training and started again each time: every step's loss and the final weights are the
    uninterrupted run's, bit for bit."""
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    for project in (straight, killed):
        shutil.copytree(small_project, project)
        write_params(project, RESUMABLE)
    rng = random.Random(19)
    path = os.pathsep.join([str(REPO / "src"), str(REPO)])
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    for stage, steps in (("base", 10), ("pretrain", 12), ("sft", 6)):
        done = stage_process(straight, stage, None)
        assert done.returncode == 0, done.stderr[-2000:]
        for at in sorted(rng.sample(range(1, steps), 3)):
            proc = subprocess.Popen([sys.executable, "-m", f"stages.{stage}"], cwd=killed, env=env,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            _killed_when(proc, lambda: _steps_logged(killed, stage) >= at)  # noqa: B023 (called at once)
        done = stage_process(killed, stage, None)
        assert done.returncode == 0, done.stderr[-2000:]
    assert _losses(killed) == _losses(straight)  # exact floats
    assert sorted(_losses(straight)) == ["base", "pretrain_stage1", "pretrain_stage2", "sft"]
    weights = "models/sft/model.safetensors"
    assert (killed / weights).read_bytes() == (straight / weights).read_bytes()


def test_sigterm_stops_a_training_stage_cleanly_and_it_resumes(project_copy):
    """SIGTERM (a scheduler's stop) mid-training: exit 143 within seconds, one line saying so and
    how to go on, the MLflow run KILLED (not RUNNING forever); the rerun finishes from the
    checkpoint."""
    from mlflow.tracking import MlflowClient

    params = merge(RESUMABLE, {"train": {"base": {"steps": 400, "checkpoint_every": 2}},
                               "tracking": {"uri": f"sqlite:///{project_copy / 'mlflow.db'}"}})
    write_params(project_copy, params)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)]), "OMP_NUM_THREADS": "1"}
    begun = time.time() * 1000  # (the copied store holds other tests' runs)
    proc = subprocess.Popen([sys.executable, "-m", "stages.base"], cwd=project_copy, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 300
    while _steps_logged(project_copy, "base") < 3 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the stage ended before it was stopped"
    proc.send_signal(signal.SIGTERM)
    stopped = time.time()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and time.time() - stopped < 30, err[-3000:]  # ~1 s on a quiet machine
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == ("base: terminated (SIGTERM); no outputs were changed; "
                                            "`dvc repro base` goes on from its last checkpoint")
    assert not (project_copy / "models" / "base").exists()
    client = MlflowClient(tracking_uri=params["tracking"]["uri"])
    runs = client.search_runs([client.get_experiment_by_name("longctx").experiment_id],
                              filter_string="attributes.run_name = 'base'")
    assert [r.info.status for r in runs if r.info.start_time >= begun] == ["KILLED"]
    write_params(project_copy, merge(params, {"train": {"base": {"steps": 6}}}))
    done = stage_process(project_copy, "base", None)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (project_copy / "models" / "base" / "model.safetensors").is_file()


def test_an_eval_stopped_after_a_checkpoint_goes_on_with_the_next(small_run, tmp_path, monkeypatch):
    """SIGTERM after the first checkpoint was scored: the rerun keeps its scores (runs/eval) and
    scores the others, its outputs those of the run that was never stopped, and the scratch goes
    when the stage ends. A checkpoint, param or line of code changed since scores it again."""
    ws = tmp_path / "ws"
    env = copy_workspace(small_run[0], ws, store=False)
    straight = json.loads((ws / "metrics/eval.json").read_text())
    straight_rows = (ws / "reports/eval/prompts.jsonl").read_text()
    proc = subprocess.Popen([sys.executable, "-m", "stages.eval"], cwd=ws, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 300
    while not (ws / "runs/eval/base.json").is_file() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the stage ended before it was stopped"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err[-3000:]
    assert err.strip().splitlines()[-1] == ("eval: terminated (SIGTERM); no outputs were changed; `dvc repro eval` "
                                            "goes on after the checkpoints it scored (runs/eval)")
    assert sorted(f.name for f in (ws / "runs/eval").iterdir()) == ["base.json"]
    done = subprocess.run([sys.executable, "-m", "stages.eval"], cwd=ws, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    kept = [c for c in straight["tasks"] if f"eval {c}: scored by an earlier run" in done.stdout]
    assert kept == ["base"] and "eval pretrain_stage1: mean task score" in done.stdout
    assert not (ws / "runs/eval").exists()
    resumed = json.loads((ws / "metrics/eval.json").read_text())
    for section in ("tasks", "cells", "means", "verdicts", "windows", "position_loss", "formats", "near_misses"):
        assert resumed[section] == straight[section], section
    assert sum(cell["wrong"] for by in resumed["near_misses"].values() for cell in by.values()) > 0
    assert (ws / "reports/eval/prompts.jsonl").read_text() == straight_rows

    from longctx import config
    from stages import eval as stage

    monkeypatch.chdir(ws)
    cfg = config.load("params.yaml")

    def key(cfg=cfg, name="base"):
        return stage.scored_key(stage.run_key(cfg, "cpu"), name, Path("models/base"))

    before = key()
    assert key() == before
    assert key(name="sft") != before
    assert key(cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"samples": 7})})) != before
    weights = ws / "models/base/model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert key() != before
    before = key()
    with (ws / "src/longctx/eval/tasks.py").open("a") as fh:
        fh.write("\n")
    assert key() != before
    (ws / "runs/eval").mkdir(parents=True)
    (ws / "runs/eval/base.json").write_text('{"key": "')  # cut mid-write: scored again
    assert stage.scored_before("base", before) is None


@pytest.mark.slow
def test_ctrl_c_on_the_main_command_stops_it_in_seconds_and_records_the_flow_run(tmp_path):
    """Ctrl-C at the terminal (SIGINT to the whole process group) while base trains: the stage
    says what it kept, the main command exits 130 within seconds with one line on how to go on,
    and the flow run is recorded as crashed (its temporary Prefect server outlives the signal).
    Before that, the server is killed once: it is started again and the flow goes on."""
    import sqlite3

    ws = tmp_path / "ws"
    env = dvc_workspace(ws, merge(RESUMABLE, {"train": {"base": {"steps": 400}}}))
    env |= {"PREFECT_HOME": str(tmp_path / "prefect"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "pipelines", str(ws)], cwd=ws, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            preexec_fn=_terminal_sigint)
    deadline = time.time() + 400
    while not (ws / "data" / "corpora").is_dir() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    server = _children(proc.pid, "prefect.server.api.server:create_app")
    assert len(server) == 1, server
    os.kill(server[0], signal.SIGKILL)  # the server dies mid-run: started again, the flow goes on
    while _steps_logged(ws, "base") < 3 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    assert proc.poll() is None, "the pipeline ended before it was interrupted"
    again = _children(proc.pid, "prefect.server.api.server:create_app")
    assert len(again) == 1 and again != server, again
    os.killpg(proc.pid, signal.SIGINT)  # what the terminal sends on Ctrl-C
    stopped = time.time()
    out, err = proc.communicate(timeout=120)
    took = time.time() - stopped
    assert proc.returncode == 130, (proc.returncode, err[-3000:])
    assert took < 30, took  # was 184-224 s, retrying a server the signal had killed
    assert "base: interrupted (DVC removed this stage's earlier outputs" in err, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("longctx pipeline: interrupted; finished stages are kept")
    assert "ConnectError" not in out + err
    assert "the temporary Prefect server exited (code -9); starting it again" in err
    with sqlite3.connect(tmp_path / "prefect" / "prefect.db") as db:
        states = db.execute("SELECT state_type FROM flow_run").fetchall()
        tasks = dict(db.execute("SELECT name, state_type FROM task_run").fetchall())
    assert states == [("CRASHED",)], states
    assert tasks == {"dvc repro corpora": "COMPLETED", "dvc repro tokenize": "COMPLETED",
                     "dvc repro pack": "COMPLETED", "dvc repro base": "CRASHED"}, tasks
    assert not Path(f"/proc/{again[0]}").exists()  # the server went with the command


def _terminal_sigint() -> None:
    """SIGINT as a terminal's foreground command has it: a suite started in the background (`cmd &`
    in a script, nohup) runs with SIGINT ignored, which its children would inherit."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _children(pid: int, marker: str) -> list[int]:
    """Live processes started by `pid` whose command line holds `marker`."""
    found = []
    for d in Path("/proc").iterdir():
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == pid and marker in (d / "cmdline").read_text():
                found.append(int(d.name))
        except (ValueError, OSError, IndexError):
            continue
    return found


LOSES_ITS_SERVER = """
import os, signal, sys, time
from pathlib import Path
from longctx.config import TrackingParams
from longctx.tracking.runs import stage_run

port, server = sys.argv[1], int(sys.argv[2])
with stage_run(TrackingParams(uri=f"http://127.0.0.1:{port}"), Path.cwd(), "base", {"lr": 1}) as tracker:
    tracker.metrics({"loss": 1.0}, step=1)
    os.killpg(server, signal.SIGKILL)
    time.sleep(1)
    start = time.perf_counter()
    tracker.metrics({"loss": 0.5}, step=2)
    with tracker.nested("pretrain_stage1", {}) as child:
        child.metrics({"loss": 0.25}, step=1)
    tracker.text("done", "done.txt")
    print(f"went on for {time.perf_counter() - start:.1f} s")
"""


@pytest.mark.slow
def test_a_tracking_server_that_dies_mid_stage_is_said_once_and_the_stage_goes_on(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(["mlflow", "server", "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
                               "--host", "127.0.0.1", "--port", str(port)], cwd=tmp_path, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).close()
                break
            except OSError:
                time.sleep(0.5)
        env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}  # (set by in-process runs)
        env["PYTHONPATH"] = str(REPO / "src")
        done = subprocess.run([sys.executable, "-c", LOSES_ITS_SERVER, str(port), str(server.pid)], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=300)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr.count("stopped answering") == 1, done.stderr[-2000:]
    assert f"tracking: the MLflow server at http://127.0.0.1:{port} stopped answering" in done.stderr
    assert "Traceback" not in done.stderr
    assert float(re.search(r"went on for ([\d.]+) s", done.stdout).group(1)) < 60

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'server.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("longctx").experiment_id])
    assert [m.value for m in client.get_metric_history(run.info.run_id, "base/loss")] == [1.0]  # what it had
