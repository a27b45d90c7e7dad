"""Training on one GPU as the stages run it (bf16 compute copies over fp32 masters, compiled
blocks, the chunked loss): compiled and eager give the same loss curve within bf16 tolerance,
the compute copies follow FSDP2's world of one (what offloading runs), the recomputation
policies give the same losses with less memory, and a checkpoint of the single-GPU model
resumes the same run. Skipped without CUDA."""

from __future__ import annotations

import copy

import pytest
import torch

from longctx.model.config import FoxConfig, ModelConfig, RopeConfig
from longctx.perf import prepared
from longctx.train import checkpoint
from longctx.train.batches import Batch, packed_batch
from longctx.train.loop import autocast
from longctx.train.parallel import Parallel

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

DEV = torch.device("cuda")


def config(arch: str) -> ModelConfig:
    return ModelConfig(vocab_size=1024, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=512,
                       max_position_embeddings=8192, rope=None if arch == "fox" else RopeConfig(),
                       fox=FoxConfig() if arch == "fox" else None)


def batch(step: int, tokens: int = 4096) -> list[Batch]:
    """A packed sequence of documents from a few tokens to past 1024 (both cuDNN routes), built
    from a repeating pattern so the loss can fall."""
    gen = torch.Generator().manual_seed(step)
    cuts = torch.randperm(tokens - 1, generator=gen)[:4].sort().values + 1
    cu = torch.cat([torch.tensor([0]), cuts, torch.tensor([tokens])]).to(torch.int32)
    ids = (torch.arange(tokens) * 7 + torch.randint(0, 3, (tokens,), generator=gen)) % 1024
    return [packed_batch(ids, cu, DEV, [step])]


def curve(arch: str, compile: bool, recompute: str = "none", steps: int = 20, tokens: int = 4096,
          offload: bool = False):
    torch.cuda.reset_peak_memory_stats()
    run = prepared(config(arch), Parallel(device=DEV), compile=compile, recompute=recompute, acp=arch == "fox",
                   offload=offload, lr=2e-3)
    losses = [run.step(batch(i, tokens))[1] for i in range(steps)]
    return losses, torch.cuda.max_memory_allocated() / 2**30, run


@pytest.mark.parametrize("arch", ["llama", "fox"])
def test_compiled_training_follows_eager(arch):
    """20 steps of eager training; before each, the compiled twin takes the eager weights and
    optimizer state, so every step compares the two on the same state (free-running curves part
    by chance: bf16 rounding grows along training at this learning rate, 4% by step 15)."""
    from torch._dynamo.utils import counters

    _, _, twin = curve(arch, compile=False, steps=0)
    breaks = sum(counters["graph_break"].values())
    _, _, compiled = curve(arch, compile=True, steps=0)
    losses, moved, apart = [], 0.0, 0.0
    for i in range(20):
        before = {k: v.clone() for k, v in twin.model.state_dict().items()}
        compiled.model.load_state_dict(before)
        compiled.opt.load_state_dict(copy.deepcopy(twin.opt.state_dict()))  # (it would share the tensors)
        losses.append((twin.step(batch(i))[1], compiled.step(batch(i))[1]))
        after, other = twin.model.state_dict(), compiled.model.state_dict()
        moved += sum(float((after[k] - before[k]).abs().sum()) for k in before)
        apart += sum(float((after[k] - other[k]).abs().sum()) for k in before)
    assert sum(counters["graph_break"].values()) == breaks  # whole blocks in one graph each
    assert losses[-1][0] < losses[0][0] - 0.3  # it learns (H200: 6.98 -> 5.97 in 20 steps)
    for step, (a, b) in enumerate(losses):
        assert abs(a - b) <= 0.01 * abs(a), (step, a, b)
    assert apart < 0.25 * moved, (apart, moved)  # the updates agree: gradients match within bf16
    if arch == "fox":
        assert 0.0 <= compiled.model.acp.stats.pruned_fraction() < 1.0


def test_compute_copies_follow_fsdp_world_of_one():
    copies, _, run = curve("llama", compile=False, steps=6)
    assert getattr(run.model, "compute_weights", None) is not None
    fsdp, _, run = curve("llama", compile=False, steps=6, offload=True)  # FSDP2, optimizer on the host
    assert getattr(run.model, "compute_weights", None) is None
    # same weights at step 0; after that the two optimizers (fused on the GPU, FSDP's on the host)
    # round differently and free-running curves drift apart by chance (H200: 0.2% by step 6)
    assert copies[0] == pytest.approx(fsdp[0], rel=1e-3)
    assert copies == pytest.approx(fsdp, rel=5e-3)
    assert copies[-1] < copies[0] - 0.05 and fsdp[-1] < fsdp[0] - 0.05  # both learn (H200: 6.98 -> 6.88)


def test_recomputation_keeps_the_losses_and_saves_memory():
    curves = {mode: curve("llama", compile=True, recompute=mode, steps=3, tokens=32768)
              for mode in ("none", "selective", "full", "halves")}
    for mode in ("selective", "full", "halves"):
        for a, b in zip(curves[mode][0], curves["none"][0], strict=True):
            assert abs(a - b) <= 0.01 * abs(b)
    assert curves["halves"][1] < curves["full"][1] < curves["selective"][1] < curves["none"][1]


def test_single_gpu_checkpoint_resumes_the_run(tmp_path):
    _, _, run = curve("llama", compile=True, steps=3)
    checkpoint.save(tmp_path, 3, run.model, run.opt, {})
    straight = [run.step(batch(i))[1] for i in (3, 4)]
    again = prepared(config("llama"), Parallel(device=DEV), compile=True, acp=False, lr=2e-3)
    assert checkpoint.load(checkpoint.latest(tmp_path), again.model, again.opt)["step"] == 3
    resumed = [again.step(batch(i))[1] for i in (3, 4)]
    assert resumed == pytest.approx(straight, rel=1e-3)


@pytest.mark.parametrize("arch", ["llama", "fox"])
def test_reading_a_step_does_not_wait_for_the_next(arch):
    """The loop reads step k (loss, norm; ACP's tile counts) after queuing step k+1: the read must
    wait for step k alone, so the GPU still has step k+1 to run while the host logs and loads."""
    from longctx.train.loop import Readback, queue_step

    run = prepared(config(arch), Parallel(device=DEV), compile=False, acp=arch == "fox", lr=2e-3)
    for i in range(2):  # warm-up: the first step's allocations and kernel choices
        run.step(batch(i))
    first = queue_step(run.model, run.opt, batch(2), run.par, 1.0)
    counts = Readback(list(run.model.acp.stats.take())) if arch == "fox" else None
    second = queue_step(run.model, run.opt, batch(3), run.par, 1.0)
    torch.cuda._sleep(2_000_000_000)  # step k+1 made long: ~1 s of GPU time behind it
    loss = first.result().loss
    pending = not torch.cuda.current_stream().query()  # what was queued after step k still runs
    if counts is not None:
        kept, total = counts.read()
        assert 0 < kept <= total
    assert pending and loss == loss  # (a NaN would not equal itself)
    assert second.result().loss == second.result().loss


def test_prepared_offload_moves_the_block_inputs_and_changes_nothing():
    """offload_activations through the loop's own `prepare`, compiled: each block's input is in host
    memory between the forward and its recomputation, the GPU's peak is lower, and loss and
    gradients are the plain run's (the first H100 run offloaded nothing: "cuda" != "cuda:0").
    Gradients compare by each parameter's relative error: bf16 kernels that add in another order
    part elementwise (an H200 failed an elementwise check at 41% of the embedding's entries, the
    offload correct: offload_check gave 0.6% by norm for every variant, plain or not; docs/benchmarks.md)."""
    from longctx.config import RunParams
    from longctx.perf import prepared_as

    cfg = config("llama").model_copy(update={"n_layers": 6})
    b = batch(0, 8192)[0]
    results = {}
    for offload, keep in ((False, 0), (True, 0), (True, 2)):
        torch.cuda.empty_cache()
        run = prepared_as(cfg, Parallel(device=DEV), RunParams(steps=1, lr=1e-3, activation_checkpointing="full",
                                                               offload_activations=offload, mlp_tile=1024,
                                                               offload_keep_last=keep))
        for _ in range(2):  # the first pass compiles; the same weights for every run (no update)
            run.opt.zero_grad(set_to_none=True)
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            with autocast(run.model, DEV):  # (as the loop runs it: the H200 run called the model in fp32 here)
                loss = run.model(b.ids, b.cu_seqlens.tolist(), labels=b.labels)
                held = run.model.layers[0].offload.pending() if offload else 0
                loss.backward()
        grads = [p.grad.float().clone() for p in run.model.parameters()]
        results[offload, keep] = (float(loss), grads, torch.cuda.max_memory_allocated() - base, held)
        if offload:
            assert run.model.layers[0].offload.pending() == 0
            assert [blk.offload is None for blk in run.model.layers] == [i >= cfg.n_layers - keep
                                                                    for i in range(cfg.n_layers)]
    plain, grads, peak, _ = results[False, 0]
    one_input = 8192 * cfg.d_model * 2
    for keep in (0, 2):
        moved, grads2, _, held = results[True, keep]
        assert held == cfg.n_layers - keep  # these blocks' inputs on the host until the backward
        assert moved == pytest.approx(plain, rel=1e-4)
        for a, b2 in zip(grads, grads2, strict=True):
            assert float((a - b2).norm() / a.norm()) < 0.03  # (a wrong or raced input: errors of order 1)
    # the peak (in the backward, where the block being recomputed and the prefetched one are back on the
    # GPU) is lower by more than an input: H200, 8,192 tokens, 6 blocks: 93.4 MB plain, 86.0 offloaded
    peaks = {k: v[2] for k, v in results.items()}
    assert peaks[True, 0] < peak - one_input, peaks
