"""Measuring training: timed optimizer steps of a model prepared as the training stages prepare
it, model FLOP utilisation against the datasheet peak and the measured matmul rate, where a
step's GPU time goes (torch.profiler, by kernel kind), and benchmark results as JSON named by
benchmark, device and date. What bench/ builds on."""

from __future__ import annotations

import datetime
import json
import math
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import RunParams
from .model.config import ModelConfig
from .train.batches import Batch, packed_batch
from .train.compiled import graphs_compiled
from .train.flops import MATMUL_BF16_FLOPS, flop_params, kept_fraction, micro_flops, peak_flops
from .train.loop import prepare, queue_step, train_step
from .train.models import build
from .train.optim import adamw
from .train.parallel import Parallel

ACP_EPS = math.exp(-10)


def one_document(tokens: int, vocab: int, device: torch.device, seed: int = 0) -> Batch:
    ids = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(seed))
    return packed_batch(ids, torch.tensor([0, tokens], dtype=torch.int32), device, [seed])


@dataclass
class Run:
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    par: Parallel
    cfg: RunParams

    def step(self, micro: list[Batch]) -> tuple[float, float]:
        """One timed optimizer step: (seconds, the device drained before and after; loss)."""
        self.sync()
        t0 = time.perf_counter()
        loss = train_step(self.model, self.opt, micro, self.par, self.cfg.clip, self.cfg.loss_chunk).loss
        self.sync()
        return time.perf_counter() - t0, loss

    def sync(self) -> None:
        if self.par.device.type == "cuda":
            torch.cuda.synchronize()


def prepared(cfg: ModelConfig, par: Parallel, *, compile: bool, recompute: str = "none", acp: bool = False,
             backend: str = "auto", lr: float = 1e-4, **loop) -> Run:
    """A fresh model of `cfg` made on the device and prepared by the training loop's own
    `prepare` (FSDP2 mixed precision, compiled blocks, checkpointing, ACP, and whatever other
    RunParams `loop` names: offload, mlp_tile, offload_activations, offload_keep_last)."""
    return prepared_as(cfg, par, RunParams(steps=1, lr=lr, compile=compile, activation_checkpointing=recompute,
                                           acp_eps=ACP_EPS if acp else None, **loop), backend)


def prepared_as(cfg: ModelConfig, par: Parallel, loop: RunParams, backend: str = "auto") -> Run:
    """A fresh model of `cfg` (initialised from `loop.seed`, as a base stage's) prepared with a
    training stage's own loop settings."""
    torch._dynamo.reset()  # graphs of another shape must not turn this one's sizes dynamic
    model = build(cfg, backend, loop.seed, par.device)
    prepare(model, loop, par)
    return Run(model, adamw(model, loop.lr, loop.betas, loop.weight_decay), par, loop)


def measure(run: Run, batches, steps: int, warmup: int = 2, log=None) -> dict:
    """Mean step time, tokens/s per GPU and model FLOP utilisation over `steps` steps queued as
    the training loop queues them (each one's loss read after the next is queued), after `warmup`
    and `steps` isolated steps (the device drained before and after each: `isolated_step_s`; the
    first step's time, compilation included, reported apart), and every step's loss.
    `batches(i)` gives this rank's micro-batches of step i; `log(line)`, if given, hears of each
    isolated step as it ends (at a million tokens a step takes minutes)."""
    from torch._dynamo.utils import counters

    graphs0, breaks0 = graphs_compiled(), dict(counters["graph_break"])
    params = flop_params(run.model)
    isolated, losses = [], []
    for i in range(warmup + steps):
        sec, loss = run.step(batches(i))
        losses.append(loss)
        if log is not None:
            gpu = run.par.device.type == "cuda"  # (this rank's peak alone: no collective for a log line)
            log(f"step {i + 1} of {warmup + 2 * steps}: {sec:.1f} s, loss {loss:.4f}"
                + (f", peak {torch.cuda.max_memory_allocated(run.par.device) / 2**30:.1f} GiB" if gpu else ""))
        if i == 0:
            first = sec
        if i >= warmup:
            isolated.append(sec)
    acp = run.model.acp
    if acp is not None:
        acp.stats.take()  # count the timed steps' tiles alone
    micro_batches, tokens, queued = [], 0.0, None
    run.sync()
    t0 = time.perf_counter()
    for i in range(warmup + steps, warmup + 2 * steps):
        micro = batches(i)
        step = queue_step(run.model, run.opt, micro, run.par, run.cfg.clip, run.cfg.loss_chunk)
        if queued is not None:
            losses.append(queued.result().loss)
        queued = step
        micro_batches += micro
        tokens += run.par.sum(sum(b.ids.numel() for b in micro)) / run.par.sp
    losses.append(queued.result().loss)
    run.sync()
    seconds = time.perf_counter() - t0
    kept = kept_fraction(acp.stats.take()) if acp is not None else 1.0
    executed, dense = micro_flops(run.model.cfg, params, micro_batches, kept)  # executed: ACP's kept tiles
    flops = run.par.sum(executed) / run.par.sp
    out = {"step_s": round(seconds / steps, 4), "isolated_step_s": round(sum(isolated) / steps, 4),
           "first_step_s": round(first, 2), "graphs_compiled": graphs_compiled() - graphs0,
           "tokens_per_s_per_gpu": round(tokens / seconds / run.par.world, 1), "losses": losses,
           "graph_breaks": {k[:600]: v - breaks0.get(k, 0) for k, v in counters["graph_break"].items()
                            if v > breaks0.get(k, 0)}}
    for key, table in (("mfu", None), ("mfu_matmul_ceiling", MATMUL_BF16_FLOPS)):
        peak = peak_flops(run.par.device) if table is None else peak_flops(run.par.device, table)
        if peak:
            out[key] = round(flops / seconds / peak / run.par.world, 4)
    out.update(peak_memory(run.par))
    if acp is not None:
        out["acp_pruned_fraction"] = round(run.par.sum(1.0 - kept) / run.par.world, 4)
        # what dense attention would have cost at this speed, a rate (it may pass the peak), not a utilisation
        out["dense_equivalent_tflops"] = round(run.par.sum(dense) / run.par.sp / seconds / run.par.world / 1e12, 1)
    return out


def peak_memory(par: Parallel) -> dict:
    """The mean over ranks of each one's peak GPU memory (nothing on a CPU), and of each process's
    peak resident host memory over its lifetime (offloaded state and activations live there)."""
    host = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # (kilobytes on Linux)
    out = {"peak_host_memory_gib": round(par.sum(host) / par.world / 2**30, 2)}
    if par.device.type == "cuda":
        out["peak_memory_gib"] = round(par.sum(torch.cuda.max_memory_allocated(par.device)) / par.world / 2**30, 2)
    return out


KINDS = [("attention", ("flash", "fmha", "attn", "cudnn", "_fwd_kernel", "_dq_kernel", "_dkdv_kernel",
                        "_bounds_kernel")),
         ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "mm_", "triton_tem")),
         ("optimizer", ("multi_tensor", "adam")),
         ("collective", ("nccl",)),
         ("fused elementwise (compiled)", ("triton_",)),
         ("copy/cast", ("copy", "cat", "memcpy", "memset")),
         ("elementwise/reduce (eager)", ("elementwise", "reduce", "softmax", "index", "scatter", "gather", "scan"))]


def kind_of(kernel: str) -> str:
    low = kernel.lower()
    return next((kind for kind, keys in KINDS if any(k.lower() in low for k in keys)), "other")


def profile(run: Run, micro: list[Batch]) -> dict:
    """One step under torch.profiler: GPU kernel ms by kind, their sum against the step's wall
    ms (the difference is the GPU waiting on the host), the costliest kernels, what made the
    host wait (device syncs, by the Python line that asked) and where the GPU waited (idle_gaps)."""
    import warnings
    from collections import Counter

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught, \
                torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            warnings.simplefilter("always")
            with torch.profiler.record_function(_STEP):
                wall, _ = run.step(micro)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))
    kinds: dict[str, float] = {}
    kernels = []
    for e in prof.key_averages():
        ms = getattr(e, "self_device_time_total", 0) / 1e3
        if ms and str(e.device_type).endswith("CUDA") and "#" not in e.key and e.key != _STEP:  # not annotations
            kinds[kind_of(e.key)] = kinds.get(kind_of(e.key), 0.0) + ms
            kernels.append((round(ms, 2), e.count, e.key[:100]))
    return {"wall_ms": round(wall * 1e3, 1), "kernel_ms": round(sum(kinds.values()), 1),
            "by_kind_ms": {k: round(v, 1) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
            "top_kernels": sorted(kernels, reverse=True)[:25], "syncs": dict(syncs.most_common(10)),
            **idle_gaps(prof.events())}


_STEP = "longctx.step"


def idle_gaps(events, shortest_us: float = 20.0, listed: int = 8) -> dict:
    """Where inside the profiled step the GPU had nothing to run, between its kernels and copies
    (all streams merged; annotations are not work): the idle time in all, the kernels run, the
    gaps of at least `shortest_us` (the host late to launch) with their sum, and the longest with
    their place in the step and the kernels either side. Many short gaps and no long ones: the
    cost is per kernel launched, not the host falling behind."""
    from torch.autograd import DeviceType

    step = next(e for e in events if e.name == _STEP)
    busy = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                  if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start
                  and e.name != _STEP and not getattr(e, "is_user_annotation", False))
    gaps, at, before = [], step.time_range.start, "(step start)"
    for start, end, name in busy:
        if start > at:
            gaps.append((start - at, at - step.time_range.start, before, name))
        if end > at:
            at, before = end, name
    long = sorted((g for g in gaps if g[0] >= shortest_us), reverse=True)
    return {"idle_ms": round(sum(g[0] for g in gaps) / 1e3, 2), "kernels": len(busy),
            "long_gaps": len(long), "idle_in_long_gaps_ms": round(sum(g[0] for g in long) / 1e3, 2),
            "longest_gaps": [{"ms": round(g / 1e3, 3), "at_ms": round(t / 1e3, 2), "after": a[:70], "before": b[:70]}
                             for g, t, a, b in long[:listed]]}


def write_result(out: Path, benchmark: str, fields: dict, device: str | None = None, quiet: bool = False) -> Path:
    """`device` defaults to the current CUDA device's name."""
    date = datetime.date.today().isoformat()
    device = device or torch.cuda.get_device_name()
    result = {"benchmark": benchmark, "date": date, "device": device, "torch": torch.__version__, **fields}
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{benchmark}-{device.replace(' ', '-').lower()}-{date}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    if not quiet:
        print(f"wrote {path}")
    return path
