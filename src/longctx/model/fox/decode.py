"""One new token's attention over a KV cache (Triton), with or without the FoX decay: the decode
step of `model/decode.py` on CUDA. Reading the cache is the whole cost (bf16 keys and values,
fp32 Lambda), so the keys are split into chunks across programs (flash-decoding) to keep every
SM reading, each program keeps an fp32 running softmax, and the chunks are merged after.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kernel import LOG2E

CHUNKS_PER_SM = 2  # programs per SM to aim for when splitting the keys
_LOG2E: tl.constexpr = tl.constexpr(LOG2E)


@triton.jit(do_not_specialize=["CHUNK"])  # lengths change every token: no recompiling as they do
def _decode_kernel(Q, K, V, LAMQ, LAMK, M, L, ACC, LENS, DOCS, CHUNK, skb, sk, slkb, slk, scale, H: tl.constexpr,
                   GROUPS: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BN: tl.constexpr, DECAY: tl.constexpr,
                   GATHER: tl.constexpr):
    h = tl.program_id(0)
    c = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)  # (a batch's cache passes 2^31 elements at ~2.8M cached tokens)
    doc = tl.load(DOCS + b).to(tl.int64) if GATHER else b  # the query's document in the cache
    dims = tl.arange(0, DP)  # D padded to a power of two
    real = dims < D
    row = b * H + h  # (document, head): q, lam_q and the partial results are [B, H, ...] contiguous
    q = tl.load(Q + row * D + dims, mask=real, other=0.0).to(tl.float32) * scale
    lam_q = tl.load(LAMQ + row) if DECAY else 0.0
    K += doc * skb + (h // GROUPS) * D
    V += doc * skb + (h // GROUPS) * D
    LAMK += doc * slkb + h
    lo = c * CHUNK
    hi = tl.minimum(lo + CHUNK, tl.load(LENS + b))  # a shorter document's last chunks read nothing
    m = -float("inf")
    den = 0.0
    acc = tl.zeros([DP], tl.float32)
    for k0 in range(lo, hi, BN):
        cols = k0 + tl.arange(0, BN)
        inside = cols < hi
        k = tl.load(K + cols[:, None] * sk + dims[None, :], mask=inside[:, None] & real[None, :], other=0.0)
        s = tl.sum(k.to(tl.float32) * q[None, :], 1)
        if DECAY:
            s += (lam_q - tl.load(LAMK + cols * slk, mask=inside, other=0.0)) * _LOG2E
        s = tl.where(inside, s, -float("inf"))
        m_new = tl.maximum(m, tl.max(s, 0))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new)
        v = tl.load(V + cols[:, None] * sk + dims[None, :], mask=inside[:, None] & real[None, :], other=0.0)
        den = den * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), 0)
        m = m_new
    n_chunks = tl.num_programs(1)
    tl.store(M + row * n_chunks + c, m)
    tl.store(L + row * n_chunks + c, den)
    tl.store(ACC + (row * n_chunks + c) * D + dims, acc, mask=real)


@torch.compiler.disable  # traced by torch.compile, the scale reached the kernel as fp64 (a compiled model's decode)
def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lam_q: torch.Tensor | None = None,
                     lam_k: torch.Tensor | None = None, scale: float | None = None,
                     lengths: torch.Tensor | None = None, docs: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one query per head q [H, D] over all cached keys k, v [T, Hkv, D] (any
    strides with a unit last dim, e.g. a view of a larger buffer), plus lam_q [H] - lam_k[T, H]
    (fp32 cumulative log forget gates) for FoX. Returns [H, D] in q's dtype.

    Batched, one launch for B documents (a decode step's): q [B, H, D] over k, v [B, T, Hkv, D],
    lam_q [B, H], lam_k [B, T, H], document b reading its first lengths[b] keys (integers on q's device).
    `docs` [B]: query b reads document docs[b] of the cache instead, so that several queries of one
    document (a decode step's guessed tokens, each over the keys up to its own) go in one launch."""
    if q.dim() == 2:
        return decode_attention(q[None], k[None], v[None], None if lam_q is None else lam_q[None],
                                None if lam_k is None else lam_k[None], scale)[0]
    b, h, d = q.shape
    t, hk = k.shape[1], k.shape[2]
    if t == 0 or h % hk or k.stride(-1) != 1 or v.stride() != k.stride() or docs is None and k.shape[0] != b:
        raise ValueError(f"decode attention: {b} x {h} heads over a cache {tuple(k.shape)} with strides {k.stride()} "
                         f"(v {v.stride()}): needs keys for each document, heads divisible by KV heads, and k, v "
                         "laid out alike")
    if lengths is None:
        lengths = torch.full((b,), t, dtype=torch.int32, device=q.device)
    decay = lam_q is not None
    if decay:
        lam_q, lam_k = lam_q.float().contiguous(), lam_k if lam_k.stride(-1) == 1 else lam_k.contiguous()
    block = 64
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
    chunks = max(1, min(triton.cdiv(t, 4 * block), triton.cdiv(CHUNKS_PER_SM * sms, b * h)))
    chunk = triton.cdiv(triton.cdiv(t, chunks), block) * block
    chunks = triton.cdiv(t, chunk)
    m, den = (torch.empty(b, h, chunks, dtype=torch.float32, device=q.device) for _ in range(2))
    acc = torch.empty(b, h, chunks, d, dtype=torch.float32, device=q.device)  # the kernel stores D of its DP
    scale = (d**-0.5 if scale is None else scale) * LOG2E
    _decode_kernel[(h, chunks, b)](
        Q=q.contiguous(), K=k, V=v, LAMQ=lam_q if decay else m, LAMK=lam_k if decay else m, M=m, L=den, ACC=acc,
        LENS=lengths, DOCS=lengths if docs is None else docs,
        CHUNK=chunk, skb=k.stride(0), sk=k.stride(1), slkb=lam_k.stride(0) if decay else 0,
        slk=lam_k.stride(1) if decay else 0, scale=scale, H=h, GROUPS=h // hk, D=d,
        DP=max(16, 1 << (d - 1).bit_length()), BN=block, DECAY=decay, GATHER=docs is not None, num_warps=4)
    w = torch.exp2(m - m.amax(-1, keepdim=True))  # merge the chunks' running softmaxes (a chunk past a
    return ((acc * w[..., None]).sum(-2) / (den * w).sum(-1, keepdim=True)).to(q.dtype)  # length: weight 0)
