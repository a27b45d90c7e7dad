"""Triton kernels for the inference forward's elementwise work (fused.py decides when they run).

Eager PyTorch spends a kernel and a round trip through memory on every step of RMSNorm (cast,
square, mean, rsqrt, scale, cast, gain), of the rotary embedding on the strided per-head view
(slice, negate, concatenate, two products, a sum) and of SwiGLU's gate (silu, product): at the
eval's 4K prompts those took ~44% of the prefill's GPU time, at 64K ~15%
(bench/results/eval-throughput/eval-throughput-nvidia-h200-2026-12-03, the profile's kernel table). Each kernel
here reads its inputs once, computes in fp32 and writes once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The token counts are not specialised on: a decode step's count (1, or not a multiple of 16) would
# otherwise compile each kernel again in the middle of a timed eval.
ROWS = 4
"""RMSNorm's tokens a program: enough work per program at d_model 768 without spilling at 4096."""
SILU_BLOCK = 4096


@triton.jit(do_not_specialize=["n"])
def _rms_norm(x_ptr, w_ptr, y_ptr, n, stride_x, stride_y, eps, C: tl.constexpr, BLOCK: tl.constexpr,
              ROWS: tl.constexpr):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)  # (offsets past 2^31)
    cols = tl.arange(0, BLOCK)
    mask = (rows[:, None] < n) & (cols[None, :] < C)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, axis=1) / C + eps)
    normed = (x32 * rstd[:, None]).to(x.dtype).to(tl.float32)  # eager rounds to x's dtype before the gain
    w = tl.load(w_ptr + cols, mask=cols < C, other=0.0).to(tl.float32)
    y = w[None, :] * normed
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / rms(x)) over the last dimension, in the dtype eager promotion gives."""
    c = x.shape[-1]
    rows = x.reshape(-1, c)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    n = rows.shape[0]
    if n:
        _rms_norm[(triton.cdiv(n, ROWS),)](rows, weight, y, n, rows.stride(0), y.stride(0), eps, C=c,
                                          BLOCK=triton.next_power_of_2(c), ROWS=ROWS)
    return y.view(x.shape)


@triton.jit(do_not_specialize=["n"])
def _rotate(x_ptr, cos_ptr, sin_ptr, y_ptr, n, heads, stride_xn, stride_xh, stride_c, stride_yn, stride_yh,
            HALF: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)  # (offsets past 2^31)
    cols = tl.arange(0, BLOCK)
    mask = (rows[:, None] < n) & (cols[None, :] < HALF)
    c_at = rows[:, None] * stride_c + cols[None, :]  # the tables once for all heads of these tokens
    c1 = tl.load(cos_ptr + c_at, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + c_at + HALF, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + c_at, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + c_at + HALF, mask=mask, other=0.0).to(tl.float32)
    out = y_ptr.dtype.element_ty
    for head in range(heads):
        x_at = x_ptr + rows[:, None] * stride_xn + head * stride_xh + cols[None, :]
        x1 = tl.load(x_at, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_at + HALF, mask=mask, other=0.0).to(tl.float32)
        y_at = y_ptr + rows[:, None] * stride_yn + head * stride_yh + cols[None, :]
        tl.store(y_at, (x1 * c1 - x2 * s1).to(out), mask=mask)
        tl.store(y_at + HALF, (x2 * c2 + x1 * s2).to(out), mask=mask)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """rope.rotate on packed heads x [N, heads, head_dim] with tables [N, head_dim] (or [1, N,
    head_dim]), into a new contiguous tensor of `dtype`."""
    n, heads, d = x.shape
    cos, sin = cos.reshape(n, d), sin.reshape(n, d)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    y = torch.empty((n, heads, d), dtype=dtype, device=x.device)
    block = triton.next_power_of_2(d // 2)
    rows = max(1, 2048 // block)
    if n:
        _rotate[(triton.cdiv(n, rows),)](x, cos, sin, y, n, heads, x.stride(0), x.stride(1), cos.stride(0),
                                         y.stride(0), y.stride(1), HALF=d // 2, BLOCK=block, ROWS=rows)
    return y


@triton.jit(do_not_specialize=["size"])
def _silu_mul(g_ptr, u_ptr, y_ptr, size, BLOCK: tl.constexpr):
    at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = at < size
    g = tl.load(g_ptr + at, mask=mask, other=0.0)
    g32 = g.to(tl.float32)
    silu = (g32 / (1.0 + tl.exp(-g32))).to(g.dtype).to(tl.float32)  # eager rounds silu's output first
    u = tl.load(u_ptr + at, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + at, (silu * u).to(y_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, elementwise over tensors of one shape."""
    g, u = gate.contiguous(), up.contiguous()
    y = torch.empty(g.shape, dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)
    if g.numel():
        _silu_mul[(triton.cdiv(g.numel(), SILU_BLOCK),)](g, u, y, g.numel(), BLOCK=SILU_BLOCK)
    return y
