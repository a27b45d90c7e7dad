"""The training loop shared by the base, pretrain and SFT stages.

One optimizer step = `grad_accum` micro-batches of `micro_batch` packed sequences. The loss is
the exact mean over every valid token of the step (not a mean of micro-batch means), which is
what SFT needs when valid tokens per micro-batch vary widely. The data order is a pure function
of (seed, step), so a resumed run sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ..config import TrainConfig
from ..data.loader import PackedDataset
from ..errors import LongctxError
from ..model.loss import IGNORE, chunked_cross_entropy, shift_labels
from ..model.transformer import Transformer
from . import checkpoint
from .optim import adamw, lr_at

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12}


class TrainingDiverged(LongctxError):
    """The loss became NaN or infinite; no checkpoint was written for that step."""


@dataclass
class Batch:
    ids: torch.Tensor
    cu_seqlens: torch.Tensor
    labels: torch.Tensor
    samples: list[int]


@functools.lru_cache(maxsize=4)
def _epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


def sample_indices(step: int, per_step: int, n: int, seed: int) -> list[int]:
    """The dataset indices of one step: epochs are seeded permutations, walked in order."""
    return [int(_epoch_order(n, seed, g // n)[g % n]) for g in range(step * per_step, (step + 1) * per_step)]


def make_batch(data: PackedDataset, samples: list[int], device: torch.device) -> Batch:
    ids, cus, labels = [], [], []
    offset = 0
    for i in samples:
        s = data[i]
        t = torch.from_numpy(s.input_ids.astype("int64"))
        cu = torch.from_numpy(s.cu_seqlens.astype("int64"))
        mask = None if s.loss_mask is None else torch.from_numpy(s.loss_mask.astype("int64"))
        labels.append(shift_labels(t, cu, mask))
        ids.append(t)
        cus.append(cu[:-1] + offset)
        offset += t.numel()
    cu_all = torch.cat([*cus, torch.tensor([offset])]).to(torch.int32)
    return Batch(torch.cat(ids).to(device), cu_all.to(device), torch.cat(labels).to(device), samples)


def step_flops(model: Transformer, batch: Batch) -> float:
    """Model FLOPs of a forward+backward: 6 per parameter per token, plus causal attention."""
    cfg = model.cfg
    params = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    lengths = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).double()
    attn = 6 * cfg.n_layers * cfg.n_heads * cfg.dim_head * float((lengths**2).sum())
    return 6 * params * batch.ids.numel() + attn


def _peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def train(model: Transformer, data: PackedDataset, cfg: TrainConfig, out: Path, tracker=None,
          resume: bool = True) -> dict:
    """Train for cfg.steps optimizer steps; checkpoints under out/checkpoints, one JSON line of
    metrics per step in out/metrics.jsonl. Resumes from the latest checkpoint when there is one."""
    device = next(model.parameters()).device
    opt = adamw(model, cfg.lr, cfg.betas, cfg.weight_decay)
    model.checkpoint_layers = cfg.activation_checkpointing
    ckpt_dir = out / "checkpoints"
    log_path = out / "metrics.jsonl"
    start = 0
    found = checkpoint.latest(ckpt_dir) if resume else None
    if found is not None:
        start = checkpoint.load(found, model, opt)["step"]
    out.mkdir(parents=True, exist_ok=True)
    _truncate_log(log_path, start)
    per_step = cfg.micro_batch * cfg.grad_accum
    peak = _peak_flops(device)
    last = {}
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc="train", unit="step")
    for step in bar:
        t0 = time.perf_counter()
        samples = sample_indices(step, per_step, len(data), cfg.seed)
        micro = [make_batch(data, samples[i:i + cfg.micro_batch], device)
                 for i in range(0, per_step, cfg.micro_batch)]
        valid = sum(int((b.labels != IGNORE).sum()) for b in micro)
        lr = lr_at(step, cfg.steps, cfg.lr, cfg.warmup, cfg.lr_min)
        for g in opt.param_groups:
            g["lr"] = lr
        total = 0.0
        for b in micro:
            with _autocast(device):
                hidden = model.hidden(b.ids, b.cu_seqlens)
            loss = chunked_cross_entropy(hidden, model.lm_head.weight, b.labels, cfg.loss_chunk) / max(valid, 1)
            if not torch.isfinite(loss):
                docs = [data.provenance(i) for i in b.samples]
                raise TrainingDiverged(f"step {step}: loss is {loss.item()}; no checkpoint written for it (last "
                                       f"good: {checkpoint.latest(ckpt_dir)}); sequences {b.samples}, documents "
                                       f"{json.dumps(docs)[:2000]}")
            loss.backward()
            total += loss.item()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip))
        if not math.isfinite(grad_norm):
            raise TrainingDiverged(f"step {step}: gradient norm is {grad_norm}; no checkpoint written for it")
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        tokens = sum(b.ids.numel() for b in micro)
        last = {"step": step + 1, "loss": total, "lr": lr, "grad_norm": grad_norm, "tokens": tokens,
                "valid_tokens": valid, "tokens_per_s": tokens / seconds}
        if peak:
            last["mfu"] = sum(step_flops(model, b) for b in micro) / seconds / peak
            last["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        with log_path.open("a") as fh:
            fh.write(json.dumps(last) + "\n")
        if tracker is not None:
            tracker.metrics({k: v for k, v in last.items() if k != "step"}, step=step + 1)
        bar.set_postfix(loss=f"{total:.4f}", lr=f"{lr:.2e}")
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
            checkpoint.save(ckpt_dir, step + 1, model, opt, {"samples_seen": (step + 1) * per_step},
                            cfg.keep_last)
    bar.close()
    if not last and log_path.is_file():  # resumed a run that had already finished
        last = json.loads(log_path.read_text().splitlines()[-1])
    return last


@torch.no_grad()
def mean_loss(model: Transformer, data: PackedDataset, sequences: int, loss_chunk: int = 2048) -> float:
    """Mean next-token loss over the valid tokens of the first `sequences` sequences."""
    device = next(model.parameters()).device
    total, valid = 0.0, 0
    for i in range(min(sequences, len(data))):
        b = make_batch(data, [i], device)
        with _autocast(device):
            hidden = model.hidden(b.ids, b.cu_seqlens)
        total += float(chunked_cross_entropy(hidden, model.lm_head.weight, b.labels, loss_chunk))
        valid += int((b.labels != IGNORE).sum())
    return total / max(valid, 1)


def _truncate_log(path: Path, step: int) -> None:
    """Drop metric lines past the step a run resumes from (they will be logged again)."""
    if not path.is_file():
        return
    keep = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in keep))


def _autocast(device: torch.device):
    """bf16 autocast on GPU; full fp32 on CPU (exact, and bitwise reproducible)."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
