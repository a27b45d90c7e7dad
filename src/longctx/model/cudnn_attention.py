"""Document-masked causal attention through cuDNN's fused kernel (the 'cudnn' backend, CUDA).

cuDNN's dense attention is 1.5x FlashAttention-2's on Hopper (H200, 16K tokens, heads x D =
2048, fwd + bwd: 9.0 against 13.8 ms at D 64, 7.3 against 12.3 at D 128), but its variable-
length (ragged) mode in torch 2.11 returns NaN gradients and faults; and each sequence length
is a new cuDNN execution plan. So every document of at least LONG_DOC tokens is one dense causal
call, its length padded up to one of a few sizes per octave (padding after a causal document
changes none of its rows, and padded rows get no gradient), and the shorter documents, cheap
under a quadratic cost, go through FlashAttention-2's varlen kernel in one call.

The plan (which document goes where) is made on the host from boundaries the caller read
without a device sync, and both passes are custom ops, so torch.compile sees one op each.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .transfer import to_device

LONG_DOC = 1024
"""Documents at least this long take the cuDNN kernel; shorter ones FlashAttention-2's."""
NATIVE_GQA = os.environ.get("LONGCTX_CUDNN_GQA", "repeat") == "native"
"""k/v of fewer heads than q straight to cuDNN, which takes them (probed on an H200: errors as
MHA's), instead of copies repeated to q's heads (at 1M tokens a rank, ~12 GiB of copies a layer's
backward): LONGCTX_CUDNN_GQA=native, off until the CUDA tests have run it."""


def padded_length(length: int) -> int:
    """The length rounded up to a multiple of 1/16 to 1/8 of its power of two (at least 128):
    a few cuDNN plans per octave, at most ~13% more causal work."""
    step = max(128, 1 << max(0, length.bit_length() - 4))
    return -(-length // step) * step


@dataclass(frozen=True)
class Plan:
    long_docs: torch.Tensor
    """int64 [n, 3] on the host: start, length and padded length of each long document, then
    rows of zeros (none) up to a count fixed by the tokens."""
    short_index: torch.Tensor
    """int64 on the device: the token positions of the short documents, in order."""
    short_cu: torch.Tensor
    """int32 on the device: the short documents' boundaries within short_index."""


def plan(bounds: list[int], device: torch.device) -> Plan:
    long, short, short_cu = [], [], [0]
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        if b - a >= LONG_DOC:
            long.append((a, b - a, padded_length(b - a)))
        elif b > a:
            short.append(torch.arange(a, b))
            short_cu.append(short_cu[-1] + b - a)
    index = torch.cat(short) if short else torch.zeros(0, dtype=torch.int64)
    # one shape for every batch of a length (zero rows after the documents): torch.compile
    # specializes on sizes 0 and 1, and recompiled per count until its limit made the blocks eager
    long += [(0, 0, 0)] * (max(2, (bounds[-1] - bounds[0]) // LONG_DOC) - len(long))
    return Plan(torch.tensor(long, dtype=torch.int64).reshape(-1, 3), to_device(index, device),
                to_device(torch.tensor(short_cu, dtype=torch.int32), device))


def _dense(t: torch.Tensor, start: int, length: int, padded: int, heads: int) -> torch.Tensor:
    """Rows [start, start + length) of a packed [N, h, D] tensor as a [1, heads, padded, D]
    tensor in cuDNN's BSHD layout, zero rows appended, grouped heads repeated to `heads` unless
    NATIVE_GQA (then they keep their own)."""
    rows = t[start:start + length]
    if rows.shape[1] != heads and not NATIVE_GQA:
        rows = rows.repeat_interleave(heads // rows.shape[1], dim=1)
    if padded != length:
        rows = torch.cat((rows, rows.new_zeros(padded - length, *rows.shape[1:])))
    return _private(rows.transpose(0, 1)[None])


def _private(t: torch.Tensor) -> torch.Tensor:
    """t [1, H, L, D] with a batch stride no other caller's tensors have (one block and 8 elements).

    PyTorch caches cuDNN's attention graphs keyed by the q/k/v sizes and strides alone, yet
    builds the output's gradient strides into the backward graph. F.scaled_dot_product_attention
    (which picks cuDNN on Hopper) hands it a gradient of another layout than our [L, H, D] rows:
    on q/k/v of one key, whichever built the graph first got right gradients and the other wrong
    ones (issue 32's -0.17 cosine: bench/backend_grads.py ran sdpa first; bench/cudnn_grads.py
    --shared-keys shows both orders). The batch holds one entry, so its stride addresses nothing."""
    return t.as_strided(t.shape, (t.numel() + 8, *t.stride()[1:]))


def _grouped(grad: torch.Tensor, heads: int) -> torch.Tensor:
    """[L, H, D] gradients of repeated heads summed back to [L, heads, D]."""
    if grad.shape[1] == heads:
        return grad
    return grad.unflatten(1, (heads, grad.shape[1] // heads)).sum(2)


@torch.library.custom_op("longctx::doc_attention", mutates_args=())
def doc_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, long_docs: torch.Tensor,
                  short_index: torch.Tensor, short_cu: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [N, H, D], log-sum-exp [H, N] fp32)."""
    n, h, _ = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(h, n, dtype=torch.float32, device=q.device)
    for start, length, padded in long_docs.tolist():
        if not length:
            continue
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(
            *(_dense(t, start, length, padded, h) for t in (q, k, v)), None, True, 0.0, True, False, scale=scale)
        out[start:start + length] = res[0][0, :, :length].transpose(0, 1)
        lse[:, start:start + length] = res[1][0, :, :length, 0]
    if short_index.numel():
        qs, ks, vs = (t.index_select(0, short_index) for t in (q, k, v))
        # LONG_DOC bounds the short documents' lengths (FlashAttention sizes its grid by it)
        o, lse_s, *_ = torch.ops.aten._flash_attention_forward(qs, ks, vs, short_cu, short_cu, LONG_DOC, LONG_DOC,
                                                               0.0, True, False, scale=scale)
        out.index_copy_(0, short_index, o)
        lse.index_copy_(1, short_index, lse_s)
    return out, lse


@doc_attention.register_fake
def _(q, k, v, long_docs, short_index, short_cu, scale):
    return torch.empty_like(q), q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)


@torch.library.custom_op("longctx::doc_attention_backward", mutates_args=())
def doc_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                           lse: torch.Tensor, long_docs: torch.Tensor, short_index: torch.Tensor,
                           short_cu: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    h, hk = q.shape[1], k.shape[1]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    unused = torch.zeros((), dtype=torch.int64, device=q.device)  # dropout's seed and offset
    for start, length, padded in long_docs.tolist():
        if not length:
            continue
        lse_d = lse.new_zeros(1, h, padded, 1)
        lse_d[0, :, :length, 0] = lse[:, start:start + length]
        dense = [_dense(t, start, length, padded, h) for t in (grad, q, k, v, out)]
        g = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            *dense, lse_d, unused, unused, None, None, None, padded, padded, 0.0, True, scale=scale)
        dq[start:start + length] = g[0][0, :, :length].transpose(0, 1)
        dk[start:start + length] = _grouped(g[1][0, :, :length].transpose(0, 1), hk)
        dv[start:start + length] = _grouped(g[2][0, :, :length].transpose(0, 1), hk)
    if short_index.numel():
        picked = [t.index_select(0, short_index) for t in (grad, q, k, v, out)]
        rng = torch.zeros(2, dtype=torch.uint64, device=q.device)
        gq, gk, gv = torch.ops.aten._flash_attention_backward(
            *picked, lse.index_select(1, short_index).contiguous(), short_cu, short_cu, LONG_DOC, LONG_DOC, 0.0,
            True, rng, torch.empty(0, device=q.device), scale=scale)
        dq.index_copy_(0, short_index, gq)
        dk.index_copy_(0, short_index, gk)
        dv.index_copy_(0, short_index, gv)
    return dq, dk, dv


@doc_attention_backward.register_fake
def _(grad, q, k, v, out, lse, long_docs, short_index, short_cu, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output):
    q, k, v, long_docs, short_index, short_cu, scale = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], long_docs, short_index, short_cu)
    ctx.scale = scale


def _backward(ctx, grad, _grad_lse):
    q, k, v, out, lse, long_docs, short_index, short_cu = ctx.saved_tensors
    dq, dk, dv = doc_attention_backward(grad.contiguous(), q, k, v, out, lse, long_docs, short_index, short_cu,
                                        ctx.scale)
    return dq, dk, dv, None, None, None, None


doc_attention.register_autograd(_backward, setup_context=_setup)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, plan_: Plan | None = None,
           scale: float | None = None) -> torch.Tensor:
    if plan_ is None:  # boundaries read from the device: one sync (training passes a plan)
        plan_ = plan(cu_seqlens.tolist(), q.device)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k, v = (t.contiguous() for t in (q, k, v))
    return doc_attention(q, k, v, plan_.long_docs, plan_.short_index, plan_.short_cu, scale)[0]
