"""Forgetting attention (FoX) in Triton, with Adaptive Computation Pruning (ACP).

Packed layout as in `attention`: q [N, H, D], k and v [N, Hkv, D], documents given by
cu_seqlens. The decay enters as Lambda [H, N] (per-document cumulative log forget gates, fp32),
premultiplied by log2(e) like the logit scale so every exponential is an exp2.

Bounds live on a grid of TILE-token blocks. For each query block, `kstart` is the first key
tile any of its rows visits: its document's start, moved right past the tiles whose decay is
under the ACP threshold. For each key tile, `qend` is the first query block that no longer
visits it. Forward and dq walk keys from kstart to the diagonal; dk/dv walk queries from the
diagonal to qend: pruned tiles are never loaded. Kernels may visit a superset of the kept tiles
(their blocks are coarser than TILE); every extra entry is one ACP allows to drop, so it is kept.

Every kernel splits its loop into masked stretches (the diagonal, and keys of an earlier
document inside a block) and an unmasked middle, so the common tile pays no mask.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import INTERPRET
from .acp import Acp, thresholds
from .reference import doc_cumsum

TILE = 64
LOG2E = 1.4426950408889634


# ---------------------------------------------------------------------------------------------
# bounds: one program per head, a single forward-moving pointer over key tiles (linear time)

@triton.jit
def _bounds_kernel(LAM, DELTA, START, KSTART, QEND, N, NB, ACP: tl.constexpr, T: tl.constexpr):
    h = tl.program_id(0)
    lam = LAM + h * N
    kstart = KSTART + h * NB
    qend = QEND + h * NB
    delta = tl.load(DELTA + h)
    p = h * 0
    for qb in range(NB):
        qf = qb * T
        s = tl.load(START + qf) // T
        while p < s:  # tiles of earlier documents: no later query block sees them
            tl.store(qend + p, qb)
            p += 1
        if ACP:
            lam_q = tl.load(lam + qf)
            go = p < qb
            while go:
                # the largest decay in tile p for this block's rows is lam[qf] - lam[tile end]
                prune = lam_q - tl.load(lam + p * T + T - 1) < delta
                tl.store(qend + p, qb, mask=prune)
                p += prune.to(tl.int32)
                go = prune & (p < qb)
        tl.store(kstart + qb, p)
    for t in range(p, NB):
        tl.store(qend + t, NB)


# ---------------------------------------------------------------------------------------------
# forward

@triton.jit
def _load_keys(kp, vp, lamk, cols, dims, sk, N, MASK: tl.constexpr):
    """A key block's k, v and Lambda; bounds-checked only where the block may pass the end."""
    if MASK:
        inside = cols < N
        k = tl.load(kp + cols[:, None] * sk + dims[None, :], mask=inside[:, None], other=0.0)
        v = tl.load(vp + cols[:, None] * sk + dims[None, :], mask=inside[:, None], other=0.0)
        lam_k = tl.load(lamk + cols, mask=inside, other=0.0)
    else:
        k = tl.load(kp + cols[:, None] * sk + dims[None, :])
        v = tl.load(vp + cols[:, None] * sk + dims[None, :])
        lam_k = tl.load(lamk + cols)
    return k, v, lam_k


@triton.jit
def _fwd_tiles(acc, den, m, q, lam_q, st_q, rows, kp, vp, lamk, lo, hi, sk, N, scale,
               D: tl.constexpr, BN: tl.constexpr, MASK: tl.constexpr, PREC: tl.constexpr):
    dims = tl.arange(0, D)
    for k0 in range(lo, hi, BN):
        cols = k0 + tl.arange(0, BN)
        k, v, lam_k = _load_keys(kp, vp, lamk, cols, dims, sk, N, MASK)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale + (lam_q[:, None] - lam_k[None, :])
        if MASK:
            keep = (cols[None, :] <= rows[:, None]) & (cols[None, :] >= st_q[:, None])
            s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        den = den * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m = m_new
    return acc, den, m


@triton.jit
def _key_side(K, V, LAM, START, KSTART, h, q0, N, NB, GROUPS: tl.constexpr, D: tl.constexpr, BM: tl.constexpr,
              BN: tl.constexpr, T: tl.constexpr):
    """What query block [q0, q0 + BM) of head h reads keys from: its KV head's k and v, its
    Lambda row, and the key range: [lo, mid) masked (earlier documents inside), [mid, q0)
    unmasked, then the diagonal."""
    lo = tl.load(KSTART + h * NB + q0 // T) * T // BN * BN
    last = tl.minimum(q0 + BM, N) - 1
    mid = tl.minimum(tl.maximum(tl.cdiv(tl.load(START + last), BN) * BN, lo), q0)
    return K + (h // GROUPS) * D, V + (h // GROUPS) * D, LAM + h * N, lo, mid


@triton.jit
def _fwd_kernel(Q, K, V, LAM, START, KSTART, OUT, LSE, N, NB, sq, sk, scale, SIZE,
                GROUPS: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                T: tl.constexpr, PREC: tl.constexpr):
    qb = tl.program_id(0)
    h = tl.program_id(1)
    q0 = qb * BM
    rows = q0 + tl.arange(0, BM)
    dims = tl.arange(0, D)
    valid = rows < N
    q = tl.load(Q + rows[:, None] * sq + h * D + dims[None, :], mask=valid[:, None], other=0.0)
    lam_q = tl.load(LAM + h * N + rows, mask=valid, other=0.0)
    st_q = tl.load(START + rows, mask=valid, other=N)
    kp, vp, lamk, lo, mid = _key_side(K, V, LAM, START, KSTART, h, q0, N, NB, GROUPS, D, BM, BN, T)
    m = tl.full([BM], -1.0e30, tl.float32)
    den = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    acc, den, m = _fwd_tiles(acc, den, m, q, lam_q, st_q, rows, kp, vp, lamk, lo, mid, sk, N, scale,
                             D, BN, True, PREC)
    acc, den, m = _fwd_tiles(acc, den, m, q, lam_q, st_q, rows, kp, vp, lamk, mid, q0, sk, N, scale,
                             D, BN, False, PREC)
    acc, den, m = _fwd_tiles(acc, den, m, q, lam_q, st_q, rows, kp, vp, lamk, q0, q0 + BM, sk, N, scale,
                             D, BN, True, PREC)
    o = acc / den[:, None]
    tl.store(OUT + rows[:, None] * sq + h * D + dims[None, :], o.to(OUT.dtype.element_ty), mask=valid[:, None])
    tl.store(LSE + h * N + rows, m + tl.log2(den), mask=valid)


# ---------------------------------------------------------------------------------------------
# backward: dq and the query-side dLambda per query block; dk, dv and the key-side dLambda per
# key block (all query heads of a KV head in one program, so GQA needs no reduction pass)

@triton.jit
def _block_pair(A, B, first, stride, head, N, BLOCK: tl.constexpr, D: tl.constexpr):
    """Two [BLOCK, D] tiles of one head (q and dO, or k and v) from token `first` on, zero past N;
    with their token indices, the in-range mask and the offsets to store gradients at."""
    idx = first + tl.arange(0, BLOCK)
    valid = idx < N
    offs = idx[:, None] * stride + head * D + tl.arange(0, D)[None, :]
    a = tl.load(A + offs, mask=valid[:, None], other=0.0)
    b = tl.load(B + offs, mask=valid[:, None], other=0.0)
    return a, b, idx, valid, offs


@triton.jit
def _dq_tiles(dq, dlq, q, do, r_q, dlt, st_q, rows, kp, vp, lamk, lo, hi, sk, N, scale,
              D: tl.constexpr, BN: tl.constexpr, MASK: tl.constexpr, PREC: tl.constexpr):
    dims = tl.arange(0, D)
    for k0 in range(lo, hi, BN):
        cols = k0 + tl.arange(0, BN)
        k, v, lam_k = _load_keys(kp, vp, lamk, cols, dims, sk, N, MASK)
        p = tl.exp2(tl.dot(q, tl.trans(k), input_precision=PREC) * scale + (r_q[:, None] - lam_k[None, :]))
        if MASK:
            keep = (cols[None, :] <= rows[:, None]) & (cols[None, :] >= st_q[:, None])
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        ds = p * (dp - dlt[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
        dlq += tl.sum(ds, 1)
    return dq, dlq


@triton.jit
def _dq_kernel(Q, K, V, DO, LAM, ROW, DELTA, START, KSTART, DQ, DLQ, N, NB, sq, sk, scale, sm_scale, SIZE,
               GROUPS: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
               T: tl.constexpr, PREC: tl.constexpr):
    h = tl.program_id(1)
    q0 = tl.program_id(0) * BM
    q, do, rows, valid, offs = _block_pair(Q, DO, q0, sq, h, N, BM, D)
    r_q = tl.load(ROW + h * N + rows, mask=valid, other=0.0)
    dlt = tl.load(DELTA + h * N + rows, mask=valid, other=0.0)
    st_q = tl.load(START + rows, mask=valid, other=N)
    kp, vp, lamk, lo, mid = _key_side(K, V, LAM, START, KSTART, h, q0, N, NB, GROUPS, D, BM, BN, T)
    dq = tl.zeros([BM, D], tl.float32)
    dlq = tl.zeros([BM], tl.float32)
    dq, dlq = _dq_tiles(dq, dlq, q, do, r_q, dlt, st_q, rows, kp, vp, lamk, lo, mid, sk, N, scale,
                        D, BN, True, PREC)
    dq, dlq = _dq_tiles(dq, dlq, q, do, r_q, dlt, st_q, rows, kp, vp, lamk, mid, q0, sk, N, scale,
                        D, BN, False, PREC)
    dq, dlq = _dq_tiles(dq, dlq, q, do, r_q, dlt, st_q, rows, kp, vp, lamk, q0, q0 + BM, sk, N, scale,
                        D, BN, True, PREC)
    tl.store(DQ + offs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=valid[:, None])
    tl.store(DLQ + h * N + rows, dlq, mask=valid)


@triton.jit
def _dkdv_tiles(dk, dv, dlk, k, v, lam_k, cols, qp, dop, row_p, dlt_p, START, lo, hi, sq, N, scale,
                D: tl.constexpr, BM: tl.constexpr, MASK: tl.constexpr, PREC: tl.constexpr):
    dims = tl.arange(0, D)
    for q0 in range(lo, hi, BM):
        rows = q0 + tl.arange(0, BM)
        if MASK:
            valid = rows < N
            q = tl.load(qp + rows[:, None] * sq + dims[None, :], mask=valid[:, None], other=0.0)
            do = tl.load(dop + rows[:, None] * sq + dims[None, :], mask=valid[:, None], other=0.0)
            r_q = tl.load(row_p + rows, mask=valid, other=0.0)
            dlt = tl.load(dlt_p + rows, mask=valid, other=0.0)
            st_q = tl.load(START + rows, mask=valid, other=N)
        else:
            q = tl.load(qp + rows[:, None] * sq + dims[None, :])
            do = tl.load(dop + rows[:, None] * sq + dims[None, :])
            r_q = tl.load(row_p + rows)
            dlt = tl.load(dlt_p + rows)
        qk = tl.dot(k, tl.trans(q), input_precision=PREC)  # [BN, BM]
        pt = tl.exp2(qk * scale + (r_q[None, :] - lam_k[:, None]))
        if MASK:
            keep = (cols[:, None] <= rows[None, :]) & (cols[:, None] >= st_q[None, :])
            pt = tl.where(keep, pt, 0.0)
        dv += tl.dot(pt.to(do.dtype), do, input_precision=PREC)
        dpt = tl.dot(v, tl.trans(do), input_precision=PREC)
        dst = pt * (dpt - dlt[None, :])
        dk += tl.dot(dst.to(q.dtype), q, input_precision=PREC)
        dlk += tl.sum(dst, 1)
    return dk, dv, dlk


@triton.jit
def _dkdv_kernel(Q, K, V, DO, LAM, ROW, DELTA, START, END, QEND, DK, DV, DLK, N, NB, sq, sk, scale, sm_scale,
                 SIZE, GROUPS: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 T: tl.constexpr, PREC: tl.constexpr):
    hk = tl.program_id(1)
    k0 = tl.program_id(0) * BN
    k, v, cols, inside, offs = _block_pair(K, V, k0, sk, hk, N, BN, D)
    dk = tl.zeros([BN, D], tl.float32)
    dv = tl.zeros([BN, D], tl.float32)
    # rows before the end of the first key's document see the whole block: no mask there
    doc_end = tl.load(END + k0) // BM * BM
    last_tile = (tl.minimum(k0 + BN, N) - 1) // T
    for g in range(GROUPS):
        h = hk * GROUPS + g
        lam_k = tl.load(LAM + h * N + cols, mask=inside, other=0.0)
        hi = tl.load(QEND + h * NB + last_tile) * T
        mid = tl.minimum(tl.maximum(doc_end, k0 + BN), hi)
        qp = Q + h * D
        dop = DO + h * D
        row_p = ROW + h * N
        dlt_p = DELTA + h * N
        dlk = tl.zeros([BN], tl.float32)
        dk, dv, dlk = _dkdv_tiles(dk, dv, dlk, k, v, lam_k, cols, qp, dop, row_p, dlt_p, START,
                                  k0, k0 + BN, sq, N, scale, D, BM, True, PREC)
        dk, dv, dlk = _dkdv_tiles(dk, dv, dlk, k, v, lam_k, cols, qp, dop, row_p, dlt_p, START,
                                  k0 + BN, mid, sq, N, scale, D, BM, False, PREC)
        dk, dv, dlk = _dkdv_tiles(dk, dv, dlk, k, v, lam_k, cols, qp, dop, row_p, dlt_p, START,
                                  mid, hi, sq, N, scale, D, BM, True, PREC)
        tl.store(DLK + h * N + cols, -dlk, mask=inside)
    tl.store(DK + offs, (dk * sm_scale).to(DK.dtype.element_ty), mask=inside[:, None])
    tl.store(DV + offs, dv.to(DV.dtype.element_ty), mask=inside[:, None])


# ---------------------------------------------------------------------------------------------
# launch configurations: (BM, BN, warps, stages), measured on H100/H200 (bench/attention.py)

AUTOTUNE = os.environ.get("LONGCTX_FOX_AUTOTUNE", "1") != "0"
"""LONGCTX_FOX_AUTOTUNE=0: the first configuration of each kernel, no tuning runs (each new head
dim, group size and length class otherwise compiles and times every configuration, ~30 s)."""


def _configs(options: list[tuple[int, int, int, int]]) -> list[triton.Config]:
    if INTERPRET or not AUTOTUNE:
        options = options[:1]
    return [triton.Config({"BM": bm, "BN": bn}, num_warps=w, num_stages=s) for bm, bn, w, s in options]


# fwd and dq: BM in {64, 128} (query blocks start on a TILE); dk/dv: BM divides TILE. Registers
# and spills of each: bench/kernel_resources.py (no GPU needed); the last dq and dk/dv options are
# the ones without spills at D = 128 there
FWD_OPTIONS = [(128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3), (128, 128, 8, 4), (128, 64, 8, 4),
               (128, 128, 8, 2), (64, 64, 4, 3)]
DQ_OPTIONS = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 4, 3),
              (64, 128, 8, 3), (128, 64, 8, 1), (64, 64, 4, 2), (64, 64, 8, 3)]
DKDV_OPTIONS = [(64, 128, 8, 2), (64, 128, 8, 3), (32, 128, 4, 3), (32, 128, 8, 3), (64, 64, 4, 3),
                (32, 64, 4, 3), (64, 128, 8, 1), (16, 128, 4, 3), (32, 128, 4, 2), (32, 64, 8, 3)]
# tuned per head dim, GQA group and power-of-two length class (not per length: prompts vary)
KEY = ["D", "GROUPS", "SIZE"]
_fwd = triton.autotune(_configs(FWD_OPTIONS), key=KEY)(_fwd_kernel)
_dq = triton.autotune(_configs(DQ_OPTIONS), key=KEY)(_dq_kernel)
_dkdv = triton.autotune(_configs(DKDV_OPTIONS), key=KEY)(_dkdv_kernel)


# ---------------------------------------------------------------------------------------------
# host side

def doc_bounds(cu_seqlens: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's document start and end (int32 [N])."""
    cu = cu_seqlens.to(torch.int32)
    lengths = (cu[1:] - cu[:-1]).long()
    return (cu[:-1].repeat_interleave(lengths, output_size=n).contiguous(),
            cu[1:].repeat_interleave(lengths, output_size=n).contiguous())


def bounds(lam2: torch.Tensor, delta: torch.Tensor | None, start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kstart [H, NB] (first key tile per query tile) and qend [H, NB] (first query tile past each
    key tile), from Lambda in log2 units [H, N] and thresholds in natural units (None: no ACP)."""
    acp = delta is not None
    delta2 = (delta * LOG2E if acp else torch.zeros(lam2.shape[0], device=lam2.device)).float().contiguous()
    return _bounds(lam2, delta2, start, acp)


@torch.library.custom_op("longctx::fox_bounds", mutates_args=())
def _bounds(lam2: torch.Tensor, delta2: torch.Tensor, start: torch.Tensor,
            acp: bool) -> tuple[torch.Tensor, torch.Tensor]:
    h, n = lam2.shape
    nb = triton.cdiv(n, TILE)
    kstart = torch.empty(h, nb, dtype=torch.int32, device=lam2.device)
    qend = torch.empty_like(kstart)
    _bounds_kernel[(h,)](LAM=lam2, DELTA=delta2, START=start, KSTART=kstart, QEND=qend, N=n, NB=nb, ACP=acp, T=TILE)
    return kstart, qend


@_bounds.register_fake
def _(lam2, delta2, start, acp):
    nb = (lam2.shape[1] + TILE - 1) // TILE
    kstart = lam2.new_empty(lam2.shape[0], nb, dtype=torch.int32)
    return kstart, torch.empty_like(kstart)


def tile_counts(kstart: torch.Tensor, start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept and total causal tiles within documents, summed over heads (device tensors)."""
    nb = kstart.shape[1]
    first = start[::TILE][:nb].long() // TILE  # each query tile's document start tile
    diag = torch.arange(1, nb + 1, device=kstart.device)
    total = (diag - first).sum() * kstart.shape[0]
    kept = (diag - kstart.long()).sum()
    return kept, total


# The kernels as custom ops: torch.compile sees one op per pass and never traces into Triton's
# launcher (autotuning and grids stay eager).

@torch.library.custom_op("longctx::fox_forward", mutates_args=())
def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lam2: torch.Tensor, start: torch.Tensor,
             end: torch.Tensor, kstart: torch.Tensor, qend: torch.Tensor,
             sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, log-sum-exp [H, N] in log2 units); `end` and `qend` ride along for the backward."""
    n, h, d = q.shape
    o = torch.empty_like(q)
    lse = torch.empty(h, n, dtype=torch.float32, device=q.device)

    def grid(meta):
        return triton.cdiv(n, meta["BM"]), h

    _fwd[grid](Q=q, K=k, V=v, LAM=lam2, START=start, KSTART=kstart, OUT=o, LSE=lse, N=n, NB=kstart.shape[1],
               sq=q.stride(0), sk=k.stride(0), scale=sm_scale * LOG2E, SIZE=n.bit_length(), GROUPS=h // k.shape[1],
               D=d, T=TILE, PREC=_precision(q))
    return o, lse


@_forward.register_fake
def _(q, k, v, lam2, start, end, kstart, qend, sm_scale):
    return torch.empty_like(q), q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)


@torch.library.custom_op("longctx::fox_backward", mutates_args=())
def _backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
              lse: torch.Tensor, lam2: torch.Tensor, start: torch.Tensor, end: torch.Tensor, kstart: torch.Tensor,
              qend: torch.Tensor, sm_scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, d Lambda in log2 units)."""
    n, h, d = q.shape
    hk = k.shape[1]
    delta = (do.float() * o.float()).sum(-1).T.contiguous()  # [H, N]
    row = lam2 - lse  # each row's Lambda minus its log-sum-exp: one add per logit, not two
    nb = kstart.shape[1]
    scale = sm_scale * LOG2E
    size = n.bit_length()
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    dlk = torch.empty(h, n, dtype=torch.float32, device=q.device)

    def kv_grid(meta):
        return triton.cdiv(n, meta["BN"]), hk

    _dkdv[kv_grid](Q=q, K=k, V=v, DO=do, LAM=lam2, ROW=row, DELTA=delta, START=start, END=end, QEND=qend, DK=dk,
                   DV=dv, DLK=dlk, N=n, NB=nb, sq=q.stride(0), sk=k.stride(0), scale=scale, sm_scale=sm_scale,
                   SIZE=size, GROUPS=h // hk, D=d, T=TILE, PREC=_precision(q))
    # dq by its own pass over key tiles: measured faster at D = 128 than atomically adding dq
    # from this kernel (16K: 12.9 vs 14.4 ms; D = 64: 14.5 vs 13.9 ms)
    dq = torch.empty_like(q)

    def dq_grid(meta):
        return triton.cdiv(n, meta["BM"]), h

    dlq = torch.empty_like(dlk)
    _dq[dq_grid](Q=q, K=k, V=v, DO=do, LAM=lam2, ROW=row, DELTA=delta, START=start, KSTART=kstart, DQ=dq, DLQ=dlq,
                 N=n, NB=nb, sq=q.stride(0), sk=k.stride(0), scale=scale, sm_scale=sm_scale, SIZE=size,
                 GROUPS=h // hk, D=d, T=TILE, PREC=_precision(q))
    # the logits hold Lambda_i - Lambda_j: dLambda = row sums - column sums of dS (natural
    # log units). The row sums vanish in exact arithmetic, but with them the rounding of the
    # bf16 output in delta cancels instead of piling up in the reverse cumsum to d log f
    # (without them d log f missed the bf16 tolerance on an H200)
    return dq, dk, dv, (dlq + dlk) / LOG2E


@_backward.register_fake
def _(do, q, k, v, o, lse, lam2, start, end, kstart, qend, sm_scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(lam2)


def _save(ctx, inputs, output):
    q, k, v, lam2, start, end, kstart, qend, sm_scale = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], lam2, start, end, kstart, qend)
    ctx.sm_scale = sm_scale


def _grads(ctx, do, _dlse):
    q, k, v, o, lse, lam2, start, end, kstart, qend = ctx.saved_tensors
    dq, dk, dv, dlam = _backward(do.contiguous(), q, k, v, o, lse, lam2, start, end, kstart, qend, ctx.sm_scale)
    return dq, dk, dv, dlam, None, None, None, None, None


_forward.register_autograd(_grads, setup_context=_save)


def _precision(q: torch.Tensor) -> str:
    """fp32 inputs get exact fp32 products (no TF32): their callers want fp32 accuracy."""
    return "ieee" if q.dtype == torch.float32 else "tf32"


def _padded_dim(d: int) -> int:
    return max(16, 1 << (d - 1).bit_length())


def fox_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                  log_f: torch.Tensor | None = None, scale: float | None = None, *,
                  acp: Acp | None = None, logit_bound: torch.Tensor | float | None = None) -> torch.Tensor:
    """Document-masked causal attention with the FoX decay, the `attention` backend signature.
    With `acp`, tiles below the threshold are skipped (forward and backward) and the kept and
    total tile counts are added to acp.stats. `logit_bound` is U for the threshold (from
    QK-norm gains); without it U comes from the max norms of q and k."""
    out, tiles = attend(q, k, v, cu_seqlens, log_f, scale, acp_eps=acp.eps if acp else None, logit_bound=logit_bound)
    if acp is not None:
        acp.stats.add(*tiles)
    return out


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
           log_f: torch.Tensor | None = None, scale: float | None = None, *, acp_eps: float | None = None,
           logit_bound: torch.Tensor | float | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`fox_attention` without side effects (what compiled code calls): (out, [kept, total]
    causal tiles, or None without ACP)."""
    n, h, d = q.shape
    if k.shape[1] == 0 or h % k.shape[1]:
        raise ValueError(f"fox attention: {h} query heads are not a multiple of {k.shape[1]} KV heads")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"fox attention takes float16/bfloat16/float32, got {q.dtype}")
    if n * h * _padded_dim(d) >= 2**31:
        raise ValueError(f"fox attention: {n} tokens x {h} heads x {d} dims overflow the kernels' 32-bit offsets; "
                         "split the heads over ranks (sequence_parallel) or the tokens over sequences")
    sm_scale = d**-0.5 if scale is None else scale
    if log_f is None:
        lam2 = torch.zeros(h, n, dtype=torch.float32, device=q.device)
    else:
        lam2 = doc_cumsum(log_f, cu_seqlens).T * LOG2E  # [H, N] contiguous: doc_cumsum scans in that layout
    start, end = doc_bounds(cu_seqlens, n)
    delta = None
    pruned = acp_eps is not None and log_f is not None
    if pruned:
        max_len = (cu_seqlens[1:] - cu_seqlens[:-1]).max()  # stays on the device: no sync per layer
        delta = thresholds(q.detach(), k.detach(), sm_scale, max_len, acp_eps, logit_bound)
    kstart, qend = bounds(lam2.detach(), delta, start)
    tiles = torch.stack(tile_counts(kstart, start)) if acp_eps is not None else None
    dp = _padded_dim(d)
    q, k, v = (torch.nn.functional.pad(t, (0, dp - d)) if dp != d else t.contiguous() for t in (q, k, v))
    out = _forward(q, k, v, lam2, start, end, kstart, qend, sm_scale)[0]
    return (out[..., :d] if dp != d else out), tiles
