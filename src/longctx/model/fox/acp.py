"""Adaptive Computation Pruning (ACP) for FoX attention: the setting, the counts of kept and
total tiles it leaves, and the per-head threshold on the decay under which a tile is skipped.
Plain PyTorch: the training loop holds an `Acp` whether or not Triton is installed."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class AcpStats:
    """Kept and total causal tiles (within documents), summed over heads and calls on the device:
    reading them is the only synchronisation, done when training logs a step."""

    kept: torch.Tensor | None = None
    total: torch.Tensor | None = None

    def add(self, kept: torch.Tensor, total: torch.Tensor) -> None:
        self.kept = kept if self.kept is None else self.kept + kept
        self.total = total if self.total is None else self.total + total

    def take(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The counts so far, still on the device, and a reset: what a queued training step keeps
        while the next one adds its own."""
        counts = None if self.total is None else (self.kept, self.total)
        self.kept = self.total = None
        return counts

    def pruned_fraction(self, reset: bool = True) -> float | None:
        """The fraction of causal tiles skipped since the last reset (None: no call yet)."""
        return pruned(self.take() if reset else None if self.total is None else (self.kept, self.total))


def pruned(counts: tuple[torch.Tensor, torch.Tensor] | None) -> float | None:
    """The skipped fraction of (kept, total) tile counts (reading them waits on the device)."""
    if counts is None:
        return None
    return 1.0 - float(counts[0]) / max(float(counts[1]), 1.0)


@dataclass
class Acp:
    """Adaptive Computation Pruning: skip tiles whose every entry carries under eps / L of its
    row's attention (eps = e^-10 in the paper), so each row loses at most eps in total."""

    eps: float = math.exp(-10)
    stats: AcpStats = field(default_factory=AcpStats)


def thresholds(q: torch.Tensor, k: torch.Tensor, scale: float, max_len: torch.Tensor, eps: float,
               logit_bound: torch.Tensor | float | None) -> torch.Tensor:
    """delta per head [H] (natural log units): -(2U + ln L) + ln eps, U a bound on |q.k| * scale:
    given (from QK-norm gains), or max_t |q_t| * max_t |k_t| * scale per head."""
    h, hk = q.shape[1], k.shape[1]
    if logit_bound is None:
        qn = q.float().norm(dim=-1).amax(0)
        kn = k.float().norm(dim=-1).amax(0).repeat_interleave(h // hk)
        u = qn * kn * scale
    elif isinstance(logit_bound, torch.Tensor):
        u = logit_bound.to(q.device, torch.float32).expand(h)
    else:  # a number: filled on the device, since copying a host tensor over would synchronise
        u = torch.full((h,), float(logit_bound), device=q.device)
    return -(2 * u + max_len.float().log()) + math.log(eps)
