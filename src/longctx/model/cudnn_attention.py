"""Document-masked causal attention through cuDNN's fused kernel (the 'cudnn' backend, CUDA).

cuDNN's dense attention is 1.5x FlashAttention-2's on Hopper (H200, 16K tokens, heads x D =
2048, fwd + bwd: 9.0 against 13.8 ms at D 64, 7.3 against 12.3 at D 128), but its variable-
length (ragged) mode in torch 2.11 returns NaN gradients and faults; and each sequence length
is a new cuDNN execution plan. So every document long enough to pay for a call of its own
(`long_doc`) is one dense causal call of one of a few sizes per octave: its length padded up by
the rows after it (a causal document's rows never see them, and the backward gives them no
probability), or, where the batch ends too soon for that, the size below its length, its last
rows then going to FlashAttention-2 over all its keys. So no document is ever copied. The shorter
documents go through FlashAttention-2's varlen kernel in one call.

The plan (which document goes where) is made on the host from boundaries the caller read
without a device sync, and both passes are custom ops, so torch.compile sees one op each.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .transfer import to_device

CALL_WORK = 2**34
"""A document takes a cuDNN call of its own when its causal attention, length^2 x heads x head
dim (the heads of a rank), is at least this; below it a call's fixed costs (the host loop, its
output and gradients copied into place) lose to FlashAttention-2's one call over every short document. On an H200
(cudnn_routing in docs/benchmarks.md, 2026-11-29, fwd + bwd, equal documents), cuDNN's time over FA2's: 1.10
at 4,096 tokens x 12 heads x 64 (1.3e10), 0.98 at 2,048 x 32 x 128 (1.7e10), 0.78-0.79 at
8,192 x 12 x 64 and 4,096 x 16 x 128 (3.4e10-5.2e10), 0.56-0.67 from 16K tokens; at 1,024 tokens
(every document a call, the old rule) 1.6-10.6. The gpu-64k product's 4K stages ran at 0.5-0.65x
FA2's tokens/s under that rule."""
LONG_DOC: int | None = None
"""A length in tokens that overrides CALL_WORK (tests and benches routing short documents to cuDNN)."""


@contextlib.contextmanager
def fixed_long_doc(tokens: int | None) -> Iterator[None]:
    """LONG_DOC set to `tokens` within the block (None: the rule), restored after."""
    global LONG_DOC
    before, LONG_DOC = LONG_DOC, tokens
    try:
        yield
    finally:
        LONG_DOC = before


def long_doc(width: int) -> int:
    """The shortest document that takes cuDNN, for `width` = heads x head dim on a rank."""
    if LONG_DOC is not None:
        return LONG_DOC
    return max(128, math.isqrt(-(-CALL_WORK // width) - 1) + 1)  # ceil(sqrt(CALL_WORK / width))


def _step(length: int) -> int:
    """The spacing of cuDNN's plan sizes near `length`: 1/16 to 1/8 of its power of two, at least 128."""
    return max(128, 1 << max(0, length.bit_length() - 4))


def padded_length(length: int) -> int:
    """The plan size at or above the length: a few cuDNN plans per octave, at most ~13% more causal work."""
    return -(-length // _step(length)) * _step(length)


def plan_size(start: int, length: int, end: int) -> int:
    """The rows cuDNN takes of the document at [start, start + length) in a batch of `end` tokens:
    the padded length where the batch holds that many rows from its start, else the plan size
    below its length (its last rows are FlashAttention-2's)."""
    padded = padded_length(length)
    return padded if start + padded <= end else length // _step(length) * _step(length)


@dataclass(frozen=True)
class Plan:
    long_docs: torch.Tensor
    """int64 [n, 3] on the host: start, length and plan size (`plan_size`) of each long document,
    then rows of zeros (none) up to a count fixed by the tokens."""
    short_index: torch.Tensor
    """int64 on the device: the token positions of the short documents, in order."""
    short_cu: torch.Tensor
    """int32 on the device: the short documents' boundaries within short_index."""
    long_doc: int
    """The routing's threshold: every short document is shorter."""


def plan(bounds: list[int], device: torch.device, width: int) -> Plan:
    """Where each document of `bounds` goes, for attention of `width` = heads x head dim a rank."""
    threshold = long_doc(width)
    long, short, short_cu = [], [], [0]
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        if b - a >= threshold:
            long.append((a, b - a, plan_size(a, b - a, bounds[-1])))
        elif b > a:
            short.append(torch.arange(a, b))
            short_cu.append(short_cu[-1] + b - a)
    index = torch.cat(short) if short else torch.zeros(0, dtype=torch.int64)
    # one shape for every batch of a length (zero rows after the documents): torch.compile
    # specializes on sizes 0 and 1, and recompiled per count until its limit made the blocks eager
    long += [(0, 0, 0)] * (max(2, (bounds[-1] - bounds[0]) // threshold) - len(long))
    return Plan(torch.tensor(long, dtype=torch.int64).reshape(-1, 3), to_device(index, device),
                to_device(torch.tensor(short_cu, dtype=torch.int32), device), threshold)


def _dense(t: torch.Tensor, start: int, size: int) -> torch.Tensor:
    """Rows [start, start + size) of a packed [N, h, D] tensor as a [1, h, size, D] view in cuDNN's
    BSHD layout (no copy: the rows past a document pad it, see the module's docstring). Grouped
    k/v keep their own heads: cuDNN takes fewer than q's."""
    return _private(t[start:start + size].transpose(0, 1)[None])


def _private(t: torch.Tensor) -> torch.Tensor:
    """t [1, H, L, D] with a batch stride no other caller's tensors have (one block and 8 elements).

    PyTorch caches cuDNN's attention graphs keyed by the q/k/v sizes and strides alone, yet
    builds the output's gradient strides into the backward graph. F.scaled_dot_product_attention
    (which picks cuDNN on Hopper) hands it a gradient of another layout than our [L, H, D] rows:
    on q/k/v of one key, whichever built the graph first got right gradients and the other wrong
    ones (issue 32's -0.17 cosine: backend_grads ran sdpa first; cudnn_grads --shared-keys showed
    both orders: docs/benchmarks.md). The batch holds one entry, so its stride addresses nothing."""
    return t.as_strided(t.shape, (t.numel() + 8, *t.stride()[1:]))


def _all_short(index: torch.Tensor, n: int) -> bool:
    """Whether the short documents hold all n tokens (then in order: their index is 0..n-1)."""
    return index.numel() == n


def flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                   max_q: int, max_k: int, scale: float,
                   used_k: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention-2's varlen causal forward (its mask aligned to the last key where a document has
    fewer queries than keys): (out, log-sum-exp [H, queries]). `used_k` [docs] int32: a document's
    keys are the first used_k[b] rows from cu_k[b] (a padded cache read where it lies)."""
    o, lse, *_ = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False,
                                                         scale=scale, seqused_k=used_k)
    return o, lse


def _flash_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rng = torch.zeros(2, dtype=torch.uint64, device=q.device)  # dropout's seed and offset
    grads = torch.ops.aten._flash_attention_backward(grad, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, True,
                                                     rng, torch.empty(0, device=q.device), scale=scale)
    return grads[0], grads[1], grads[2]


def _tail(start: int, length: int, size: int, device: torch.device) -> tuple[int, int, torch.Tensor, torch.Tensor]:
    """The rows [a, b) of a document past its plan size, and FlashAttention-2's boundaries for them
    as queries over all its keys."""
    a, b = start + size, start + length
    cu_q, cu_k = (to_device(torch.tensor([0, n], dtype=torch.int32), device) for n in (length - size, length))
    return a, b, cu_q, cu_k


@torch.library.custom_op("longctx::doc_attention", mutates_args=())
def doc_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, long_docs: torch.Tensor,
                  short_index: torch.Tensor, short_cu: torch.Tensor, long_doc: int,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [N, H, D], log-sum-exp [H, N] fp32)."""
    n, h, _ = q.shape
    bound = min(long_doc, n)  # (FlashAttention sizes its grid by it)
    if _all_short(short_index, n):
        return flash_forward(q, k, v, short_cu, short_cu, bound, bound, scale)
    out = torch.empty_like(q)
    lse = torch.empty(h, n, dtype=torch.float32, device=q.device)
    for start, length, size in long_docs.tolist():
        if not length:
            continue
        rows = min(length, size)
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(
            *(_dense(t, start, size) for t in (q, k, v)), None, True, 0.0, True, False, scale=scale)
        out[start:start + rows] = res[0][0, :, :rows].transpose(0, 1)
        lse[:, start:start + rows] = res[1][0, :, :rows, 0]
        if size < length:
            a, b, cu_q, cu_k = _tail(start, length, size, q.device)
            out[a:b], lse[:, a:b] = flash_forward(q[a:b], k[start:b], v[start:b], cu_q, cu_k, b - a, length, scale)
    if short_index.numel():
        o, lse_s = flash_forward(*(t.index_select(0, short_index) for t in (q, k, v)), short_cu, short_cu, bound,
                                  bound, scale)
        out.index_copy_(0, short_index, o)
        lse.index_copy_(1, short_index, lse_s)
    return out, lse


@doc_attention.register_fake
def _(q, k, v, long_docs, short_index, short_cu, long_doc, scale):
    return torch.empty_like(q), q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)


@torch.library.custom_op("longctx::doc_attention_backward", mutates_args=())
def doc_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                           lse: torch.Tensor, long_docs: torch.Tensor, short_index: torch.Tensor,
                           short_cu: torch.Tensor, long_doc: int,
                           scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    bound = min(long_doc, q.shape[0])
    if _all_short(short_index, q.shape[0]):
        return _flash_backward(grad, q, k, v, out, lse, short_cu, short_cu, bound, bound, scale)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    unused = torch.zeros((), dtype=torch.int64, device=q.device)  # dropout's seed and offset
    for start, length, size in long_docs.tolist():
        if not length:
            continue
        rows = min(length, size)
        lse_d = lse.new_full((1, q.shape[1], size, 1), math.inf)  # (the rows past the document: no probability)
        lse_d[0, :, :rows, 0] = lse[:, start:start + rows]
        dense = [_dense(t, start, size) for t in (grad, q, k, v, out)]
        g = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            *dense, lse_d, unused, unused, None, None, None, size, size, 0.0, True, scale=scale)
        for whole, part in zip((dq, dk, dv), g[:3], strict=True):
            whole[start:start + rows] = part[0, :, :rows].transpose(0, 1)
        if size < length:  # the last rows' share: their dq, and what they add to every key's dk and dv
            a, b, cu_q, cu_k = _tail(start, length, size, q.device)
            gq, gk, gv = _flash_backward(grad[a:b], q[a:b], k[start:b], v[start:b], out[a:b],
                                         lse[:, a:b].contiguous(), cu_q, cu_k, b - a, length, scale)
            dq[a:b] = gq
            for whole, part in ((dk, gk), (dv, gv)):
                whole[start:a] += part[:size]
                whole[a:b] = part[size:]
    if short_index.numel():
        grads = _flash_backward(*(t.index_select(0, short_index) for t in (grad, q, k, v, out)),
                                lse.index_select(1, short_index).contiguous(), short_cu, short_cu, bound, bound,
                                scale)
        for whole, part in zip((dq, dk, dv), grads, strict=True):
            whole.index_copy_(0, short_index, part)
    return dq, dk, dv


@doc_attention_backward.register_fake
def _(grad, q, k, v, out, lse, long_docs, short_index, short_cu, long_doc, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output):
    q, k, v, long_docs, short_index, short_cu, long_doc, scale = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], long_docs, short_index, short_cu)
    ctx.long_doc, ctx.scale = long_doc, scale


def _backward(ctx, grad, _grad_lse):
    q, k, v, out, lse, long_docs, short_index, short_cu = ctx.saved_tensors
    dq, dk, dv = doc_attention_backward(grad.contiguous(), q, k, v, out, lse, long_docs, short_index, short_cu,
                                        ctx.long_doc, ctx.scale)
    return dq, dk, dv, None, None, None, None, None


doc_attention.register_autograd(_backward, setup_context=_setup)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, plan_: Plan | None = None,
           scale: float | None = None) -> torch.Tensor:
    if plan_ is None:  # boundaries read from the device: one sync (training passes a plan)
        plan_ = plan(cu_seqlens.tolist(), q.device, q.shape[1] * q.shape[2])
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k, v = (t.contiguous() for t in (q, k, v))
    return doc_attention(q, k, v, plan_.long_docs, plan_.short_index, plan_.short_cu, plan_.long_doc, scale)[0]
