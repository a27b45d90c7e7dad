"""What makes training fast, checked on a CPU: every preset shape builds through every builder
the benchmarks and the stages use (meta device: no memory), the recomputation policies and
compiled blocks compute exactly the eager model's loss and gradients (one graph shared by all
blocks, one recompile when document boundaries first change, no graph breaks), the loss keeps
its value without gradients, and the new training keys are validated. The stage-timing bench
times a stage's own steps."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import REPO, SMALL, stage_process
from longctx import config
from longctx.config import ModelParams, merge
from longctx.errors import ConfigError
from longctx.model.config import PRESETS, FoxConfig, ModelConfig, RopeConfig
from longctx.model.fox import Acp
from longctx.model.loss import chunked_cross_entropy, shift_labels
from longctx.model.transformer import Transformer
from longctx.train.compiled import compile_blocks, graphs_compiled
from longctx.train.models import base_model, build, preset, with_positions
from longctx.train.parallel import Parallel, host_threads, shard

PARAMS = {"llama3-8b": 8.03e9, "fox-760m": 0.83e9, "fox-125m": 0.16e9}  # with embeddings; FoX adds its gates


@pytest.mark.parametrize("shape", sorted(PRESETS))
@pytest.mark.parametrize("arch", ["llama", "fox"])
def test_every_preset_builds_through_every_builder(shape, arch):
    cfg = preset(shape, arch, 65536)
    assert (cfg.rope is None) == (arch == "fox") and cfg.max_position_embeddings == 65536
    model = build(cfg, device="meta")
    n = sum(p.numel() for p in model.parameters())
    if shape in PARAMS and arch == "llama":
        assert n == pytest.approx(PARAMS[shape], rel=0.02)
    longer = with_positions(model, RopeConfig(theta=8e6), 131072)  # pretrain's base change
    assert longer.cfg.max_position_embeddings == 131072 and sum(p.numel() for p in longer.parameters()) == n
    dims = {k: v for k, v in PRESETS[shape].items() if k not in ("vocab_size", "rope")}
    params = ModelParams(arch=arch, max_position_embeddings=dims.pop("max_position_embeddings", 4096), **dims)
    staged = base_model(params, PRESETS[shape]["vocab_size"], seed=0, device="meta")  # the base stage's builder
    assert sum(p.numel() for p in staged.parameters()) == n


def test_a_preset_name_that_does_not_exist_is_refused():
    with pytest.raises(ValueError, match="model shape 'llama-9b' is unknown"):
        preset("llama-9b")


def test_tied_head_stays_tied_when_positions_change():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=50, d_model=16, n_layers=1, n_heads=2, ffn_dim=32, tie_embeddings=True))
    new = with_positions(model, RopeConfig(theta=1e5), 8192)
    assert new.lm_head.weight is new.embed_tokens.weight
    assert len(list(new.parameters())) == len(list(model.parameters()))


def small(arch: str) -> ModelConfig:
    return ModelConfig(vocab_size=97, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64,
                       rope=None if arch == "fox" else RopeConfig(), fox=FoxConfig() if arch == "fox" else None)


def twins(arch: str):
    """The same weights twice: the 'fox' kernel (Triton's interpreter here) with ACP for FoX, the
    pure-PyTorch reference for Llama (no host reads: compiles whole)."""
    backend = "fox" if arch == "fox" else "reference"
    a, b = build(small(arch), backend), build(small(arch), backend)
    if arch == "fox":
        a.acp, b.acp = Acp(), Acp()
    return a, b


def step(model, cuts: list[int], seed: int):
    ids = torch.randint(0, 97, (cuts[-1],), generator=torch.Generator().manual_seed(seed))
    loss = model(ids, cuts, labels=shift_labels(ids, torch.tensor(cuts)))
    grads = torch.autograd.grad(loss, list(model.parameters()))
    return loss.detach(), grads


LAYOUTS = ([0, 50, 128], [0, 30, 90, 128], [0, 10, 20, 100, 128])


@pytest.mark.parametrize("arch", ["llama", "fox"])
@pytest.mark.parametrize("mode", ["full", "halves", "selective", "attention"])
def test_recomputation_gives_the_same_loss_and_gradients(arch, mode):
    plain, recomputed = twins(arch)
    recomputed.recompute = mode
    for i, cuts in enumerate(LAYOUTS[:2]):
        (la, ga), (lb, gb) = step(plain, cuts, i), step(recomputed, cuts, i)
        assert torch.equal(la, lb)
        for x, y in zip(ga, gb, strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=1e-6)


class OpCounts(TorchDispatchMode):
    """How often each operator ran (what a recomputation policy replays shows up twice)."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("arch,attention_op", [("llama", "_scaled_dot_product_flash_attention_for_cpu"),
                                               ("fox", "fox_forward")])
def test_attention_recomputation_replays_all_but_attention(arch, attention_op):
    counts = {}
    for mode in ("none", "full", "attention"):
        torch.manual_seed(0)
        model = build(small(arch), "fox" if arch == "fox" else "sdpa")
        model.recompute = mode
        with OpCounts() as ops:
            step(model, [0, 128], 0)  # one document: one attention call per block
        counts[mode] = ops.counts
    blocks = small(arch).n_layers
    assert counts["none"][attention_op] == counts["attention"][attention_op] == blocks
    assert counts["full"][attention_op] == 2 * blocks
    # everything else is replayed as in full: the projections' matmuls run again
    assert counts["attention"]["mm"] == counts["full"]["mm"] > counts["none"]["mm"]


@pytest.mark.parametrize("arch,mode", [("llama", "none"), ("llama", "full"), ("fox", "selective"),
                                       ("llama", "attention")])
def test_compiled_blocks_match_eager_and_stop_recompiling(arch, mode):
    eager, compiled = twins(arch)
    eager.recompute = compiled.recompute = mode
    torch._dynamo.reset()
    compile_blocks(compiled, backend="aot_eager", fullgraph=True)  # fullgraph: a graph break is an error
    start, counts = graphs_compiled(), []
    for i, cuts in enumerate(LAYOUTS + ([0, 128], [0, 5, 60, 61, 128], [0, 127, 128], [0, 64, 128], [0, 128])):
        (la, ga), (lb, gb) = step(eager, cuts, i), step(compiled, cuts, i)
        counts.append(graphs_compiled() - start)
        torch.testing.assert_close(la, lb, rtol=1e-6, atol=0)  # traced decompositions may round differently
        for x, y in zip(ga, gb, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    # the three blocks share their graphs; the boundaries' sizes turn dynamic at their first change
    # and a one-document layout compiles once more (0/1 sizes are specialised), then nothing does
    assert counts[-1] == counts[3] <= 4, counts
    if arch == "fox":
        assert eager.acp.stats.pruned_fraction() == compiled.acp.stats.pruned_fraction()


def test_the_loss_without_gradients_is_the_same_number():
    torch.manual_seed(0)
    hidden, weight = torch.randn(37, 16, dtype=torch.float64), torch.randn(50, 16, dtype=torch.float64)
    labels = torch.randint(0, 50, (37,))
    labels[[3, 9]] = -100
    with torch.no_grad():
        plain = chunked_cross_entropy(hidden, weight, labels, chunk=8)
    graded = chunked_cross_entropy(hidden.requires_grad_(), weight, labels, chunk=8)
    torch.testing.assert_close(plain, graded.detach())


def test_training_keys_are_validated():
    cfg = config.resolve({"profile": "tiny-scratch", "train": {"base": {"activation_checkpointing": "selective",
                                                                "compile": False, "offload": False}}})
    assert cfg.train.base.activation_checkpointing == "selective" and cfg.train.base.compile is False
    assert config.resolve({"profile": "prolong-64k"}).train.pretrain.stages[0].activation_checkpointing == "attention"
    with pytest.raises(ConfigError, match="activation_checkpointing"):
        config.resolve({"profile": "tiny-scratch", "train": {"base": {"activation_checkpointing": True}}})


def test_offload_without_a_gpu_is_refused():
    with pytest.raises(ConfigError, match="offload: .* this run has no GPU"):
        shard(build(small("llama")), Parallel(), offload=True)


def test_offloading_processes_share_the_host_cores(monkeypatch):
    """torchrun's OMP_NUM_THREADS=1 would leave the offloaded optimizer step on one core."""
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert host_threads() == 8
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert host_threads() == 64
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert host_threads() == 1


def test_compute_copies_keep_fp32_masters_and_accumulate_in_fp32():
    """A single GPU's mixed precision (train/precision.py), on the CPU: forward and backward on
    bf16 copies give the masters exactly the fp32 sum of a bf16 model's per-micro-batch
    gradients (FSDP2's MixedPrecisionPolicy(bf16, fp32)); tied weights share one copy; outside
    the step the model holds its fp32 masters, and the next step sees what the optimizer did."""
    import copy

    from longctx.train.precision import attach

    torch.manual_seed(0)
    cfg = small("llama").model_copy(update={"tie_embeddings": True})
    model = build(cfg, "reference")
    reference = copy.deepcopy(model).to(torch.bfloat16)
    masters = dict(model.named_parameters())
    attach(model)
    cutsets = ([0, 50, 128], [0, 30, 90, 128])
    with model.compute_weights.active():
        assert model.lm_head.weight is model.embed_tokens.weight and model.lm_head.weight.dtype == torch.bfloat16
        for i, cuts in enumerate(cutsets):
            ids = torch.randint(0, 97, (cuts[-1],), generator=torch.Generator().manual_seed(i))
            model(ids, cuts, labels=shift_labels(ids, torch.tensor(cuts))).backward()
    expected = {n: torch.zeros_like(p) for n, p in masters.items()}
    for i, cuts in enumerate(cutsets):
        _, grads = step(reference, cuts, i)
        for (n, _), g in zip(reference.named_parameters(), grads, strict=True):
            expected[n] += g.float()
    assert dict(model.named_parameters()) == masters and model.lm_head.weight is model.embed_tokens.weight
    for n, p in masters.items():
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32
        assert torch.equal(p.grad, expected[n]), n
    assert all(c.grad is None for c in model.compute_weights.copies)  # no bf16 gradient outlives backward
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.step()
    with model.compute_weights.active():
        for n, p in model.named_parameters():
            assert torch.equal(p, masters[n].detach().to(torch.bfloat16)), n


def test_a_step_that_waits_on_the_device_once_updates_as_the_checked_one():
    """Fused AdamW's step (train_step's path on one GPU) clips and skips on the device: the same
    update as clipping and checking on the host, and a non-finite loss still raises with the
    weights and the optimizer state untouched."""
    import copy

    from longctx.train.batches import packed_batch
    from longctx.train.loop import TrainingDiverged, train_step

    par = Parallel()
    host, device = build(small("llama"), "reference"), build(small("llama"), "reference")
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=fused) for m, fused in ((host, False), (device, True))]
    for i, cuts in enumerate(LAYOUTS):
        ids = torch.randint(0, 97, (cuts[-1],), generator=torch.Generator().manual_seed(i))
        batch = [packed_batch(ids, torch.tensor(cuts, dtype=torch.int32), par.device, [i])]
        clip = 0.5 if i % 2 == 0 else 100.0  # clipping, then not
        a, b = (train_step(m, o, batch, par, clip) for m, o in zip((host, device), opts, strict=True))
        assert a.loss == pytest.approx(b.loss, rel=1e-5) and a.grad_norm == pytest.approx(b.grad_norm, rel=1e-5)
        assert (a.grad_norm > clip) == (clip == 0.5)
    for x, y in zip(host.parameters(), device.parameters(), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        device.norm.weight.fill_(float("nan"))
    weights, state = copy.deepcopy(device.state_dict()), copy.deepcopy(opts[1].state_dict())
    with pytest.raises(TrainingDiverged, match="loss is nan"):
        train_step(device, opts[1], batch, par, clip=0.5)
    for k, v in device.state_dict().items():
        torch.testing.assert_close(v, weights[k], equal_nan=True, rtol=0, atol=0)
    for key, s in opts[1].state_dict()["state"].items():
        for name, t in s.items():
            assert torch.equal(t, state["state"][key][name]), (key, name)
    assert not hasattr(opts[1], "found_inf")


def test_idle_gaps_find_where_the_gpu_waited():
    """The profile's idle report: gaps between kernels of any stream (overlapping ones merged,
    annotations ignored), counted from the step's start, the long ones listed longest first with
    their neighbours."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from longctx.perf import _STEP, idle_gaps

    def event(name, start, end, device=DeviceType.CUDA, note=False):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end),
                               is_user_annotation=note)

    events = [event(_STEP, 1000, 2000, DeviceType.CPU), event(_STEP, 1000, 2000), event("mark", 1000, 2000, note=True),
              event("cudaLaunchKernel", 1010, 1020, DeviceType.CPU),
              event("embed", 1100, 1200), event("gemm", 1210, 1400), event("side", 1250, 1450),  # overlap
              event("norm", 1700, 1750), event("adam", 1760, 1990)]
    got = idle_gaps(events, shortest_us=20)
    assert got["kernels"] == 5 and got["idle_ms"] == pytest.approx((100 + 10 + 250 + 10) / 1e3)
    assert got["long_gaps"] == 2 and got["idle_in_long_gaps_ms"] == pytest.approx(0.35)
    assert got["longest_gaps"][0] == {"ms": 0.25, "at_ms": 0.45, "after": "side", "before": "norm"}
    assert got["longest_gaps"][1] == {"ms": 0.1, "at_ms": 0.0, "after": "(step start)", "before": "embed"}


def test_the_stage_bench_times_a_stages_own_steps(project_copy, tmp_path):
    """bench/train_throughput.py --workspace times each stage that ran with its own model, settings
    and data: its first timed step is the base stage's first (the same loss from the same weights
    and samples); the stage's tokens/s is its run's, by the wall clock after the first steps."""
    params = merge(SMALL, {"train": {"base": {"steps": 8}}, "tracking": {"enabled": False}})
    assert stage_process(project_copy, "base", params).returncode == 0
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)]), "OMP_NUM_THREADS": "1"}
    bench = [sys.executable, str(REPO / "bench" / "train_throughput.py"), "--workspace", str(project_copy)]
    done = subprocess.run([*bench, "--steps", "1", "--out", str(out)], cwd=project_copy, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    [result] = out.glob("train_throughput_stages-cpu-*.json")
    [row] = json.loads(result.read_text())["rows"]  # (the other stages did not run)
    [log] = (project_copy / "runs" / "base").glob("*/metrics.jsonl")
    logged = [json.loads(line) for line in log.read_text().splitlines()]
    assert row["stage"] == "base" and row["window"] == 256 and row["micro_batch"] == 2
    assert row["losses"][0] == pytest.approx(logged[0]["loss"], rel=1e-5)
    median = statistics.median(r["tokens_per_s"] for r in logged[3:])
    assert row["stage_step_tokens_per_s"] == pytest.approx(median, rel=1e-3)
    wall = sum(r["tokens"] for r in logged[3:]) / (logged[-1]["wall_s"] - logged[2]["wall_s"])
    assert row["stage_tokens_per_s"] == pytest.approx(wall, rel=1e-3)
    assert row["stage_over_bench"] == pytest.approx(row["stage_tokens_per_s"] / row["tokens_per_s_per_gpu"], rel=1e-2)
    assert "stage/bench" in done.stdout
