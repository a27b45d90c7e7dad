"""The training loop shared by the base, pretrain and SFT stages.

One optimizer step = `grad_accum` micro-batches of `micro_batch` packed sequences, dealt over
the data-parallel replicas (the global batch does not depend on the number of GPUs). The loss
is the exact mean over every valid token of the step, on all ranks (not a mean of micro-batch
means), which is what SFT needs when valid tokens per micro-batch vary widely. The data order
is a pure function of (seed, step), so a resumed run sees exactly the batches an uninterrupted
one would; within a step, sequences are ordered by attention cost (ProLong's reordering).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from ..config import RunParams
from ..data.loader import Curriculum, PackedDataset
from ..errors import ConfigError, LongctxError
from ..io import clear_stale
from ..model.fox import Acp
from ..model.offload import HostOffload
from ..model.transfer import to_device
from ..model.transformer import Transformer, packed_positions
from ..progress import progress
from . import checkpoint
from .batches import Batch, make_batch, step_batches
from .compiled import compile_blocks
from .flops import flop_params, kept_fraction, micro_flops, peak_flops
from .optim import adamw, lr_at
from .parallel import Parallel, check_layout, layout, sequence_parallel, shard, sharded, with_sequence_parallel
from .seqpe import SeqPEStep


class TrainingDiverged(LongctxError):
    """The loss became NaN or infinite; no checkpoint was written for that step."""


def autocast(model: torch.nn.Module, device: torch.device):
    """The precision a step computes in, entered around forward and backward: the bf16 copies
    of a single GPU's weights (precision.py); bf16 autocast for a plain model on a GPU; nothing
    for an FSDP-sharded one (its policy gathers bf16 weights) or on a CPU (full fp32: exact,
    bitwise reproducible)."""
    if device.type != "cuda" or sharded(model):
        return contextlib.nullcontext()
    weights = getattr(model, "compute_weights", None)
    if weights is not None:
        return weights.active()
    return torch.autocast("cuda", dtype=torch.bfloat16)


def _check_group(model: Transformer, par: Parallel) -> None:
    """The model splits sequences over the ranks `par` counts tokens over (prepare applies it)."""
    if model.sp_group is not par.sp_group:
        raise ValueError("the model's sequence-parallel group is not this run's: prepare(model, cfg, par) first")


def step_valid(micro: list[Batch], par: Parallel) -> int:
    """Valid tokens of a step over all ranks (each sequence-parallel group counted once)."""
    return int(par.sum(sum(b.valid for b in micro) if par.sp_rank == 0 else 0))


class StepResult(NamedTuple):
    loss: float
    grad_norm: float
    """Before clipping."""
    valid_tokens: int


def train_step(model: Transformer, opt: torch.optim.Optimizer, micro: list[Batch], par: Parallel, clip: float,
               loss_chunk: int = 2048) -> StepResult:
    """One optimizer step over this rank's micro-batches: backward of each, the loss the exact
    mean over the step's valid tokens on all ranks, gradients clipped to `clip`, the update.
    Raises TrainingDiverged, without updating, when the loss or the gradient norm is not finite.
    What the training stages and every benchmark run (the loop through `queue_step`)."""
    return queue_step(model, opt, micro, par, clip, loss_chunk).result()


class Readback:
    """Scalars still on the device, copied to the host behind the work that makes them: reading
    them waits for that work alone. (`float()` of a CUDA tensor waits for everything queued so
    far: read after the next step was queued, it waited for that step too, and the GPU idled
    while the host logged and loaded the step after. One GPU: distributed steps still wait in
    their collectives' reads.)"""

    def __init__(self, values: list[torch.Tensor | float]):
        self._given = [None if isinstance(v, torch.Tensor) else float(v) for v in values]
        tensors = [v.detach().reshape(()).double() for v in values if isinstance(v, torch.Tensor)]
        self._ready = None
        if tensors and tensors[0].is_cuda:
            self._host = torch.empty(len(tensors), dtype=torch.float64, pin_memory=True)
            self._host.copy_(torch.stack(tensors), non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._read = [float(t) for t in tensors]

    def read(self) -> list[float]:
        if self._ready is not None:
            self._ready.synchronize()
            self._read, self._ready = self._host.tolist(), None
        read = iter(self._read)
        return [next(read) if v is None else v for v in self._given]


class QueuedStep:
    """A step whose update is queued: its loss and gradient norm may still be on the device.
    The training loop reads them (`result`) after queuing the next step, so between steps the
    GPU does not wait for the host to read, log and load the next batch."""

    def __init__(self, loss: torch.Tensor | float, norm: torch.Tensor | float, valid: int,
                 opt: torch.optim.Optimizer, extras: dict[str, torch.Tensor] | None = None,
                 timer: _StepTimer | None = None):
        self.valid, self._opt = valid, opt
        self._names = list(extras or {})
        """Other losses of the step (SeqPE's regularisers); `timer` times them."""
        self._values = Readback([loss, norm, *(extras or {}).values()])
        self.timer = timer

    def result(self) -> StepResult:
        """Waits for the step; raises TrainingDiverged when its loss, an extra loss (SeqPE's) or
        the gradient norm is not finite (on one GPU fused AdamW has then already skipped its
        update), naming the first that is not."""
        loss, norm, *extras = self._values.read()
        _check_finite([("loss", loss), *zip(self._names, extras, strict=True), ("gradient norm", norm)], self._opt)
        return StepResult(loss, norm, self.valid)

    def metrics(self) -> dict[str, float]:
        """The extra losses, and their milliseconds as `seqpe_regularisers_ms`."""
        timed = {"seqpe_regularisers_ms": self.timer.seconds() * 1e3} if self.timer is not None else {}
        return dict(zip(self._names, self._values.read()[2:], strict=True)) | timed


def _floats(values: dict[str, torch.Tensor]) -> list[tuple[str, float]]:
    return [(name, float(x)) for name, x in values.items()]


def queue_step(model: Transformer, opt: torch.optim.Optimizer, micro: list[Batch], par: Parallel, clip: float,
               loss_chunk: int = 2048, seqpe: SeqPEStep | None = None) -> QueuedStep:
    """`train_step` without reading its result: on one GPU with fused AdamW nothing here waits
    on the device; elsewhere the checks run on the host before the update, as they must.
    `seqpe`: the step's position shift and regularisers (SeqPE models)."""
    _check_group(model, par)
    valid = step_valid(micro, par)
    shift = seqpe.offset(max(int((b.cu_seqlens[1:] - b.cu_seqlens[:-1]).max()) for b in micro)) if seqpe else 0
    total = torch.zeros((), device=par.device)  # summed on the device: no wait between micro-batches
    for b in micro:
        positions = None
        if shift:
            positions = to_device(packed_positions(b.cu_seqlens, b.ids.numel()) + shift, par.device)
        with autocast(model, par.device):
            loss = model(b.ids, b.cu_seqlens.tolist(), positions, labels=b.labels,
                         loss_chunk=loss_chunk) / max(valid, 1)
            loss.backward()
        total += loss.detach().float()
    extras, timer = {}, None
    if seqpe is not None:
        timer = _StepTimer(par.device)
        with autocast(model, par.device):
            extras = seqpe.regularise(model, shifted=shift > 0, ranks=par.world)
        timer.stop()
    # LONGCTX_STEP_END=host: the checks on the host, to time the two side by side
    if opt.defaults.get("fused") and not par.distributed and os.environ.get("LONGCTX_STEP_END") != "host":
        return _step_on_device(model, opt, total, clip, valid, extras, timer)
    total = par.sum(float(total))
    _check_finite([("loss", total), *_floats(extras)], opt)  # before clipping: a NaN makes a NaN norm
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    _check_finite([("gradient norm", grad_norm)], opt)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return QueuedStep(total, grad_norm, valid, opt, extras, timer)


def _step_on_device(model: Transformer, opt: torch.optim.Optimizer, total: torch.Tensor, clip: float,
                    valid: int, extras: dict[str, torch.Tensor], timer: _StepTimer | None) -> QueuedStep:
    """The end of a step without waiting on the device: fused AdamW divides the gradients by the
    clipping factor and skips the whole update (moments and step count too) when told to, through
    the `grad_scale` and `found_inf` tensors that torch's GradScaler hands it; the loss and the
    norm are read later (reading them before clipping and before the update left a 760M step's
    GPU idle ~10 ms)."""
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    opt.found_inf = (~(torch.isfinite(total) & torch.isfinite(norm))).float()
    opt.grad_scale = torch.clamp((norm + 1e-6) / clip, min=1.0)  # 1 / clip_grad_norm_'s factor
    try:
        opt.step()
    finally:
        del opt.found_inf, opt.grad_scale
    opt.zero_grad(set_to_none=True)
    return QueuedStep(total, norm, valid, opt, extras, timer)


def _check_finite(values: list[tuple[str, float]], opt: torch.optim.Optimizer) -> None:
    """Raise TrainingDiverged, the step's gradients dropped, on the first non-finite value."""
    for what, value in values:
        if not math.isfinite(value):
            opt.zero_grad(set_to_none=True)
            raise TrainingDiverged(f"{what} is {value}")


class _StepTimer:
    """A step's seconds: on a GPU the device's time from the step's first queued work to its
    update (events; the host does not wait for them until the step is read), on a CPU the host's."""

    def __init__(self, device: torch.device):
        self.events = None
        if device.type == "cuda":
            self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self.events[0].record()
        self.t0 = time.perf_counter()

    def stop(self) -> None:
        if self.events is not None:
            self.events[1].record()
        self.t1 = time.perf_counter()

    def seconds(self) -> float:
        if self.events is None:
            return self.t1 - self.t0
        self.events[1].synchronize()
        return self.events[0].elapsed_time(self.events[1]) / 1e3


@dataclass
class _InFlight:
    """A queued step and what logging it needs."""

    step: int
    samples: list[int]
    micro: list[Batch]
    lr: float
    queued: QueuedStep
    timer: _StepTimer
    acp: Readback | None
    """ACP's kept and total tiles of the step."""


def _acp_counts(model: Transformer) -> Readback | None:
    counts = model.acp.stats.take() if model.acp is not None else None
    return Readback(list(counts)) if counts is not None else None


def _diverged(e: TrainingDiverged, step: int, samples: list[int], data: PackedDataset | Curriculum,
              ckpt_dir: Path) -> TrainingDiverged:
    docs = [data.provenance(i) for i in samples]
    return TrainingDiverged(f"step {step}: {e}; no checkpoint written for it (last good: "
                            f"{checkpoint.latest(ckpt_dir)}); sequences {samples}, documents "
                            f"{json.dumps(docs)[:2000]}")


def prepare(model: Transformer, cfg: RunParams, par: Parallel) -> Transformer:
    """The model as a training stage runs it: activation checkpointing, ACP, sequence parallelism
    (`par.sp_group`), FSDP2 (mixed precision on GPUs, optional offload), compiled blocks on CUDA."""
    model.recompute = cfg.activation_checkpointing
    model.acp = Acp(cfg.acp_eps) if cfg.acp_eps else None
    moved = len(model.layers) - cfg.offload_keep_last  # the first blocks' inputs go to the host
    if moved < 1:
        raise ConfigError(f"offload_keep_last: {cfg.offload_keep_last} of the model's {len(model.layers)} blocks "
                          f"would leave no block input to offload")
    if cfg.offload_activations and par.device.type != "cuda":
        raise ConfigError("offload_activations: moves activations from the GPU to host memory; this run has no GPU")
    offload = HostOffload(par.device) if cfg.offload_activations else None
    for i, block in enumerate(model.layers):
        block.mlp.tile, block.offload = cfg.mlp_tile, offload if i < moved else None
    sequence_parallel(model, par.sp_group)
    shard(model, par, offload=cfg.offload, sharding=cfg.sharding)
    if cfg.compile and par.device.type == "cuda":
        compile_blocks(model)
    return model


def train(model: Transformer, data: PackedDataset | Curriculum, cfg: RunParams, out: Path, tracker=None,
          resume: bool = True, par: Parallel | None = None) -> dict:
    """Train for cfg.steps optimizer steps; checkpoints under out/checkpoints, one JSON line of
    metrics per step in out/metrics.jsonl. Resumes from the latest checkpoint when there is one.
    Each step's loss is read after the next step is queued (the GPU never idles between steps);
    every step is read, and checked, before a checkpoint is written.
    Distributed (`par`), the model is sharded in place (`parallel.unshard` gives it back whole)
    and every rank calls this; only the main rank writes files and logs."""
    par = with_sequence_parallel(par or Parallel(device=next(model.parameters()).device),
                                 cfg.sequence_parallel, model.cfg.n_heads)
    check_layout(cfg, par.world, nodes=par.nodes)
    device = par.device
    prepare(model, cfg, par)
    if par.main and par.distributed:
        print(f"{out.parent.name}: {layout(model, par)}", file=sys.stderr)
    opt = adamw(model, cfg.lr, cfg.betas, cfg.weight_decay)
    ckpt_dir = out / "checkpoints"
    log_path = out / "metrics.jsonl"
    start = 0
    found = checkpoint.latest(ckpt_dir) if resume else None
    if found is not None:
        start = checkpoint.load(found, model, opt)["step"]
        if par.main:
            print(f"{out.parent.name}: goes on from step {start} ({found})", file=sys.stderr)
    par.barrier()  # every rank has read the checkpoint before the main rank may write the next
    if par.main:
        out.mkdir(parents=True, exist_ok=True)
        clear_stale(ckpt_dir)  # a killed run's half-written checkpoint (gigabytes at 8B)
        _truncate_log(log_path, start)
    per_step = cfg.micro_batch * cfg.grad_accum
    flops_params = flop_params(model)
    peak = peak_flops(device)
    last = {}
    in_flight: list[_InFlight] = []

    def finish(f: _InFlight) -> dict:
        """Read a queued step's results, log them; the step's metrics."""
        try:
            total, grad_norm, valid = f.queued.result()
        except TrainingDiverged as e:
            raise _diverged(e, f.step, f.samples, data, ckpt_dir) from None
        seconds = f.timer.seconds()
        tokens = int(par.sum(sum(b.ids.numel() for b in f.micro))) // par.sp
        rec = {"step": f.step + 1, "loss": total, "lr": f.lr, "grad_norm": grad_norm, "tokens": tokens,
               "valid_tokens": valid, "tokens_per_s": tokens / seconds,
               "tokens_per_s_per_rank": tokens / seconds / par.world,
               "wall_s": time.perf_counter() - began}  # (since this process began training: all it cost)
        rec |= f.queued.metrics()
        kept = kept_fraction(f.acp.read() if f.acp is not None else None)  # this rank's, for its own micro-batches
        if model.acp is not None:
            rec["acp_pruned_fraction"] = par.sum(1.0 - kept) / par.world
        executed, dense = micro_flops(model.cfg, flops_params, f.micro, kept)
        if peak:
            rec["mfu"] = par.sum(executed) / par.sp / seconds / peak / par.world
        if device.type == "cuda":
            rec["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        if model.acp is not None:  # what dense attention would have cost at this speed: not a utilisation
            rec["dense_equivalent_tflops"] = par.sum(dense) / par.sp / seconds / par.world / 1e12
        if par.main:
            with log_path.open("a") as fh:
                fh.write(json.dumps(rec) + "\n")
            if tracker is not None:
                tracker.metrics({k: v for k, v in rec.items() if k != "step"}, step=f.step + 1)
        if bar is not None:  # counts logged steps: the final count is the last step's
            bar.set_postfix(loss=f"{total:.4f}", lr=f"{f.lr:.2e}", tokens_per_s=f"{rec['tokens_per_s']:,.0f}")
            bar.update(1)
        return rec

    bar = progress(total=cfg.steps, initial=start, desc="train", unit="step") if par.main else None
    began = time.perf_counter()
    for step in range(start, cfg.steps):
        timer = _StepTimer(device)
        samples, micro = step_batches(data, step, cfg, par)
        lr = lr_at(step, cfg.steps, cfg.lr, cfg.warmup, cfg.lr_min)
        for g in opt.param_groups:
            g["lr"] = lr
        try:
            queued = queue_step(model, opt, micro, par, cfg.clip, cfg.loss_chunk, SeqPEStep.of(model, cfg, step))
        except TrainingDiverged as e:
            for f in in_flight:  # the steps before it are logged
                finish(f)
            raise _diverged(e, step, samples, data, ckpt_dir) from None
        timer.stop()
        in_flight.append(_InFlight(step, samples, micro, lr, queued, timer,
                                   _acp_counts(model)))
        # read each step after the next is queued; every one before a checkpoint is written
        save = (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps
        while len(in_flight) > (0 if save else 1):
            last = finish(in_flight.pop(0))
        if save:
            checkpoint.save(ckpt_dir, step + 1, model, opt, {"samples_seen": (step + 1) * per_step},
                            cfg.keep_last, main=par.main)
            par.barrier()
    if bar is not None:
        bar.close()
    if not last and log_path.is_file():  # resumed a run that had already finished
        last = json.loads(log_path.read_text().splitlines()[-1])
    return last


@torch.no_grad()
def mean_loss(model: Transformer, data: PackedDataset, sequences: int, loss_chunk: int = 2048,
              par: Parallel | None = None) -> float:
    """Mean next-token loss over the valid tokens of the first `sequences` sequences (spread over
    the data-parallel replicas; the result is the same on every rank)."""
    par = par or Parallel(device=next(model.parameters()).device)
    _check_group(model, par)
    total, valid = 0.0, 0
    for i in range(par.dp_rank, min(sequences, len(data)), par.dp):
        b = make_batch(data, [i], par.device, par.sp)
        with autocast(model, par.device):
            total += float(model(b.ids, b.cu_seqlens.tolist(), labels=b.labels,
                                 loss_chunk=loss_chunk))
        valid += b.valid if par.sp_rank == 0 else 0  # each sequence-parallel group counts once
    return par.sum(total) / max(par.sum(valid), 1)


def _truncate_log(path: Path, step: int) -> None:
    """Drop metric lines past the step a run resumes from (they will be logged again), and a line
    a kill tore mid-write."""
    if not path.is_file():
        return
    keep = [line for line in path.read_text().splitlines() if (rec := _record(line)) and rec["step"] <= step]
    path.write_text("".join(line + "\n" for line in keep))


def _record(line: str) -> dict | None:
    try:
        rec = json.loads(line)
    except json.JSONDecodeError:
        return None
    return rec if isinstance(rec, dict) and isinstance(rec.get("step"), int) else None
