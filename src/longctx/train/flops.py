"""What a training step computes, in model FLOPs (6 per parameter and token plus causal
attention, of which ACP runs only the kept tiles), and the GPUs' rates MFU divides by."""

from __future__ import annotations

import torch

from ..model.config import ModelConfig
from ..model.fox.acp import pruned
from .batches import Batch

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12}
MATMUL_BF16_FLOPS = {"H100": 790e12, "H200": 790e12}
"""The dense bf16 matmul rate measured on these GPUs (8192^3 products on random data): the
ceiling model FLOPs can reach, beside the datasheet peak."""


def flop_params(model: torch.nn.Module) -> int:
    """Parameters that cost 6 FLOPs per token (the embedding lookup is free; a tied head is
    counted through lm_head)."""
    return sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)


def attention_flops(cfg: ModelConfig, batch: Batch) -> float:
    """Causal attention's FLOPs in a forward+backward (the two matmuls of each head over each
    document's lower triangle, three times)."""
    lengths = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).double()
    return 6 * cfg.n_layers * cfg.n_heads * cfg.dim_head * float((lengths**2).sum())


def step_flops(cfg: ModelConfig, params: int, batch: Batch, attention_kept: float = 1.0) -> float:
    """Model FLOPs a forward+backward executes: 6 per (non-embedding) parameter per token, plus
    causal attention, of which ACP runs only the kept tiles (`attention_kept`; 1: all of it, the
    dense count). MFU divides executed FLOPs: counting pruned tiles printed MFUs above 1."""
    return 6 * params * batch.ids.numel() + attention_kept * attention_flops(cfg, batch)


def micro_flops(cfg: ModelConfig, params: int, micro: list[Batch], attention_kept: float) -> tuple[float, float]:
    """(FLOPs executed, dense-equivalent FLOPs) of one rank's micro-batches."""
    dense = sum(step_flops(cfg, params, b) for b in micro)
    return dense - (1.0 - attention_kept) * sum(attention_flops(cfg, b) for b in micro), dense


def kept_fraction(acp_counts: tuple[torch.Tensor, torch.Tensor] | list[float] | None) -> float:
    """The fraction of causal attention tiles that ran, from ACP's (kept, total) counts (1: no
    pruning, or no counts)."""
    skipped = pruned(acp_counts)
    return 1.0 if skipped is None else 1.0 - skipped


def peak_flops(device: torch.device, table: dict[str, float] = PEAK_BF16_FLOPS) -> float | None:
    """The device's dense bf16 rate from `table` (datasheet peaks, or MATMUL_BF16_FLOPS); None
    for a CPU or an unknown GPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in table.items() if k in name), None)
