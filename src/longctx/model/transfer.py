"""Host-to-device copies that do not wait: from pageable memory CUDA first synchronises the
stream, so a small host tensor (document boundaries, plans, labels) copied each forward would
stall the GPU queue; pinned, the copy is queued like a kernel."""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    if device.type == "cuda" and t.device.type == "cpu" and not torch.compiler.is_compiling():
        return t.to(dtype=dtype).pin_memory().to(device, non_blocking=True)
    return t.to(device, dtype)
