"""AdamW with the recipes' settings, and warmup + cosine to a floor."""

from __future__ import annotations

import math

import torch
from torch import nn


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only: none on norms, biases and gate biases (FoX, ProLong)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def adamw(model: nn.Module, lr: float, betas: tuple[float, float], weight_decay: float) -> torch.optim.AdamW:
    fused = all(p.is_cuda for p in model.parameters())
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=betas, fused=fused or None)


def lr_at(step: int, total: int, peak: float, warmup: float, floor: float) -> float:
    """Linear warmup over the first `warmup` fraction of `total` steps, then cosine to `floor`."""
    warm = max(1, round(warmup * total))
    if step < warm:
        return peak * (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, total - warm))
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))
