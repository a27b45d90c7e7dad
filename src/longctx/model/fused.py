"""Where the inference forward takes fused kernels (fused_triton.py) for RMSNorm, the rotary
embedding and SwiGLU's gate: on CUDA, without autograd and outside torch.compile (training keeps
the eager ops, which autograd and the compiled blocks differentiate and fuse themselves).

LONGCTX_FUSED=off keeps the eager ops everywhere (bench/eval_throughput.py --without fused
times both in one process).
"""

from __future__ import annotations

import os

import torch

FUSED = os.environ.get("LONGCTX_FUSED", "on") != "off"


def wanted(x: torch.Tensor) -> bool:
    """Whether this tensor's op should take a fused kernel."""
    return FUSED and x.is_cuda and not torch.is_grad_enabled() and not torch.compiler.is_compiling()


def kernels():
    """fused_triton, imported on first use (Triton is there wherever CUDA is)."""
    from . import fused_triton

    return fused_triton
