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

if INTERPRET:  # scans and helper calls at a fraction of the interpreter's own cost (interpreter.py)
    from . import interpreter

    interpreter.speed_up()

TILE = 64
LOG2E = 1.4426950408889634
SCAN_BLOCK = 1024  # tokens per step of the per-head scans (prepare, d log f) on a GPU
LARGEST_CLASS = int(os.environ.get("LONGCTX_FOX_LARGEST_CLASS", "16")) or None
"""One length class for every length from 32,768 up (below it each power of two its own);
LONGCTX_FOX_LARGEST_CLASS=0: a class per power of two. The tuner chose the same forward, dq and
dk/dv configurations for every class from 2**15 to 2**21 on an H200 and on an H100; with one class
a cold process tuned the bench's 10 lengths (4K-1M) in 41.7 s against 110.3 s on the H100, and the
CUDA kernel tests passed with it (bench/results/fox-tuning/fox-tuning-nvidia-h100-2026-12-07)."""

UNSPECIALISED = ["SIZE"] if LARGEST_CLASS else []
"""With one class above 2**15 the SIZE key is not specialised on (a SIZE of 16, divisible by 16,
compiled every configuration again: the 10.6 s at 32K in the H200's tuning run)."""


def _scan_block(n: int) -> int:
    """SCAN_BLOCK, or in Triton's interpreter, where a block's scan costs log2 of its size in
    whole-block numpy calls, the power of two that holds n (a test's 128 tokens: 7 steps, not 10)."""
    return min(SCAN_BLOCK, max(TILE, triton.next_power_of_2(n))) if INTERPRET else SCAN_BLOCK


# ---------------------------------------------------------------------------------------------
# what every call needs before the attention kernels, in one launch per direction: Lambda (the
# per-document cumulative sum of log forget gates), each token's document start and end, and the
# tile bounds without pruning (one program per head, the sequence in blocks, a carry between them)

_LOG2E: tl.constexpr = tl.constexpr(LOG2E)


@triton.jit
def _restart_add(first_a, a, first_b, b):
    return first_a | first_b, tl.where(first_b != 0, b, a + b)


@triton.jit
def _segment_sums(x, first):
    """Inclusive running sums of x that restart wherever `first` (int32) is set."""
    return tl.associative_scan((first, x), 0, _restart_add)[1]


@triton.jit
def _doc_of(CU, idx, DOCS, STEPS):
    """Index of the document holding each token in idx: binary search over cu_seqlens."""
    lo = idx * 0
    hi = lo + DOCS - 1
    for _ in range(STEPS):
        mid = (lo + hi + 1) // 2
        right = tl.load(CU + mid) <= idx
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid - 1)
    return lo


@triton.jit
def _prepare_kernel(LOGF, CU, LAM, START, END, KSTART, QEND, N, NB, DOCS, STEPS, sfn, sfh,
                    DECAY: tl.constexpr, BLOCK: tl.constexpr, T: tl.constexpr):
    h = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    tiles = tl.arange(0, BLOCK // T)
    carry = 0.0  # Lambda at the end of the previous block
    for b0 in range(0, N, BLOCK):
        idx = b0 + offs
        valid = idx < N
        doc = _doc_of(CU, idx, DOCS, STEPS)
        st = tl.load(CU + doc)
        if h == 0:
            tl.store(START + idx, st, mask=valid)
            tl.store(END + idx, tl.load(CU + doc + 1), mask=valid)
        # without pruning a query tile starts at its first row's document, and a key tile is
        # visited up to the end of its last row's document
        t = b0 // T + tiles
        inside = t < NB
        first = tl.load(CU + _doc_of(CU, t * T, DOCS, STEPS)) // T
        last = tl.load(CU + _doc_of(CU, tl.minimum(t * T + T - 1, N - 1), DOCS, STEPS) + 1)
        tl.store(KSTART + h * NB + t, first, mask=inside)
        tl.store(QEND + h * NB + t, tl.cdiv(last, T), mask=inside)
        if DECAY:
            x = tl.load(LOGF + idx * sfn + h * sfh, mask=valid, other=0.0).to(tl.float32)
            lam = _segment_sums(x, (idx == st).to(tl.int32))
            lam += tl.where(st < b0, carry, 0.0)
            carry = tl.sum(tl.where(offs == BLOCK - 1, lam, 0.0), 0)
        else:
            lam = tl.zeros([BLOCK], tl.float32)
        tl.store(LAM + h * N + idx, lam * _LOG2E, mask=valid)


@triton.jit
def _dlogf_kernel(DLAM, END, DLOGF, N, sfn, sfh, BLOCK: tl.constexpr):
    """d log f: dLambda (log2 units) summed from each token to its document's end, the blocks
    walked from the sequence's end and read backwards, so the scan runs forward."""
    h = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    carry = 0.0
    for b in range(0, tl.cdiv(N, BLOCK)):
        stop = N - b * BLOCK
        idx = stop - 1 - offs
        valid = idx >= 0
        en = tl.load(END + idx, mask=valid, other=0)
        g = tl.load(DLAM + h * N + idx, mask=valid, other=0.0) * _LOG2E
        acc = _segment_sums(g, (idx == en - 1).to(tl.int32))
        acc += tl.where(en > stop, carry, 0.0)
        carry = tl.sum(tl.where(offs == BLOCK - 1, acc, 0.0), 0)
        tl.store(DLOGF + idx * sfn + h * sfh, acc.to(DLOGF.dtype.element_ty), mask=valid)


@triton.jit
def _bwd_prep_kernel(DO, OUT, LAM, LSE, DELTA, ROW, N, sq, D: tl.constexpr, BLOCK: tl.constexpr,
                     WIDE: tl.constexpr):
    """delta = rowsum(dO * O), and each row's Lambda minus its log-sum-exp (one add per logit
    in the backward kernels instead of two)."""
    if WIDE:
        sq = sq.to(tl.int64)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    h = tl.program_id(1)
    valid = rows < N
    offs = rows[:, None] * sq + h * D + tl.arange(0, D)[None, :]
    do = tl.load(DO + offs, mask=valid[:, None], other=0.0).to(tl.float32)
    o = tl.load(OUT + offs, mask=valid[:, None], other=0.0).to(tl.float32)
    tl.store(DELTA + h * N + rows, tl.sum(do * o, 1), mask=valid)
    lam = tl.load(LAM + h * N + rows, mask=valid, other=0.0)
    tl.store(ROW + h * N + rows, lam - tl.load(LSE + h * N + rows, mask=valid, other=0.0), mask=valid)


# ---------------------------------------------------------------------------------------------
# bounds with pruning: one program per head, a single forward-moving pointer over key tiles
# (linear time); also the kept and total causal tiles of the head

@triton.jit
def _bounds_kernel(LAM, DELTA, START, KSTART, QEND, TILES, N, NB, ACP: tl.constexpr, T: tl.constexpr):
    h = tl.program_id(0)
    lam = LAM + h * N
    kstart = KSTART + h * NB
    qend = QEND + h * NB
    delta = tl.load(DELTA + h)
    p = h * 0
    kept = h * 0
    total = h * 0
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
        kept += qb + 1 - p
        total += qb + 1 - s
    for t in range(p, NB):
        tl.store(qend + t, NB)
    tl.store(TILES + 2 * h, kept)
    tl.store(TILES + 2 * h + 1, total)


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


@triton.jit(do_not_specialize=UNSPECIALISED)
def _fwd_kernel(Q, K, V, LAM, START, KSTART, OUT, LSE, N, NB, sq, sk, scale, SIZE,
                GROUPS: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                T: tl.constexpr, PREC: tl.constexpr, WIDE: tl.constexpr):
    if WIDE:  # elements past offset 2**31 - 1: token index x row stride in 64 bits
        sq = sq.to(tl.int64)
        sk = sk.to(tl.int64)
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


@triton.jit(do_not_specialize=UNSPECIALISED)
def _dq_kernel(Q, K, V, DO, LAM, ROW, DELTA, START, KSTART, DCOL, DQ, DLAM, N, NB, sq, sk, scale, sm_scale, SIZE,
               GROUPS: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
               T: tl.constexpr, PREC: tl.constexpr, WIDE: tl.constexpr):
    if WIDE:
        sq = sq.to(tl.int64)
        sk = sk.to(tl.int64)
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
    dcol = tl.load(DCOL + h * N + rows, mask=valid, other=0.0)  # the dk/dv kernel's column sums
    tl.store(DLAM + h * N + rows, (dlq - dcol) / _LOG2E, mask=valid)


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


@triton.jit(do_not_specialize=UNSPECIALISED)
def _dkdv_kernel(Q, K, V, DO, LAM, ROW, DELTA, START, END, QEND, DK, DV, DCOL, N, NB, sq, sk, scale,
                 sm_scale, SIZE, GROUPS: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 T: tl.constexpr, PREC: tl.constexpr, WIDE: tl.constexpr):
    if WIDE:
        sq = sq.to(tl.int64)
        sk = sk.to(tl.int64)
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
        # dLambda = row sums - column sums of dS (natural log units): the column sums here, the
        # row sums and the difference by the dq kernel after this one
        tl.store(DCOL + h * N + cols, dlk, mask=inside)
    tl.store(DK + offs, (dk * sm_scale).to(DK.dtype.element_ty), mask=inside[:, None])
    tl.store(DV + offs, dv.to(DV.dtype.element_ty), mask=inside[:, None])


# ---------------------------------------------------------------------------------------------
# launch configurations: (BM, BN, warps, stages), measured on H100/H200 (bench/attention.py)

AUTOTUNE = os.environ.get("LONGCTX_FOX_AUTOTUNE", "1") != "0"
"""LONGCTX_FOX_AUTOTUNE=0: the first configuration of each kernel, no tuning runs (each new head
dim, group size and length class otherwise compiles and times every configuration, ~30 s)."""

TUNING_CACHE = os.environ.get("LONGCTX_FOX_TUNING_CACHE", "1") == "1"
"""Tunings kept on disk across processes (each pipeline stage is one: the SFT stage then tunes
nothing, FoX pipeline run 4); LONGCTX_FOX_TUNING_CACHE=0 tunes again in every process. On since the
CUDA gradient tests (tests/test_fox_kernel.py) passed with it over 6 processes sharing one cache on
an H200 (bench/results/gpu-tests/gpu-tests-nvidia-h200-2026-11-28): a first call that reads a cached choice
skips the tuning launches that issue 31's wrong d log f lived in."""

if TUNING_CACHE and "TRITON_CACHE_DIR" not in os.environ:
    from torch._inductor.runtime.cache_dir_utils import triton_cache_dir

    os.environ["TRITON_CACHE_DIR"] = triton_cache_dir(0)
"""One folder for the tunings of every process. torch.compile (inductor) sets TRITON_CACHE_DIR to
its own folder when it builds its first kernel, and Triton reads the variable at each lookup: a
choice made before that went to ~/.triton/cache, one after it to inductor's, and the next stage
may look in the other (FoX pipeline on an H100, 2026-12-07: pretrain tuned again, 32 s, the 32K
class base had tuned; SFT the 4K class). Set to inductor's folder, whichever comes first, both
name the same one."""

# fwd and dq: BM in {64, 128} (query blocks start on a TILE) and a multiple of BN (the unmasked key
# range ends at the query block's start, q0, in whole BN steps: with BN = 128 over BM = 64 its last
# tile ran past q0, into keys after the queries, unmasked: dq read the future, or overflowed, in
# the one option that had it); dk/dv: BM divides TILE. Registers and spills of each:
# bench/kernel_resources.py (no GPU needed); the last dq and dk/dv options are the ones without
# spills at D = 128 there
FWD_OPTIONS = [(128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3), (128, 128, 8, 4), (128, 64, 8, 4),
               (128, 128, 8, 2), (64, 64, 4, 3)]
DQ_OPTIONS = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 4, 3),
              (128, 64, 8, 1), (64, 64, 4, 2), (64, 64, 8, 3)]
assert all(bm % bn == 0 for bm, bn, *_ in FWD_OPTIONS + DQ_OPTIONS), "query blocks must hold whole key tiles"
DKDV_OPTIONS = [(64, 128, 8, 2), (64, 128, 8, 3), (32, 128, 4, 3), (32, 128, 8, 3), (64, 64, 4, 3),
                (32, 64, 4, 3), (64, 128, 8, 1), (16, 128, 4, 3), (32, 128, 4, 2), (32, 64, 8, 3)]
# tuned per head dim, GQA group and length class (not per length: prompts vary)
KEY = ["D", "GROUPS", "SIZE", "WIDE"]

NARROW = os.environ.get("LONGCTX_FOX_OPTIONS", "all") == "narrow"
"""LONGCTX_FOX_OPTIONS=narrow: at head dims up to NARROW_D each kernel tunes over the options its
tuner chose there and their neighbours (13 of 25). At the gpu-64k shape (D 64) an H100 and an H200
chose forward 128/64/4/3 (64/64/4/3 at 4K), dq 64/64/4/3 and dk/dv 32/64/4/3 in every length class
from 2^13 to 2^21 (bench/results/fox-tuning), and tuning all 25 cost a FoX pipeline 34.7 s (issue
62: 30). Off until bench/fox_tuning.py times both and the CUDA kernel tests pass with it; wider
heads (the 8B shape's 128) always tune over every option."""
NARROW_D = 64
NARROW_OPTIONS = {  # each list's first kept (LONGCTX_FOX_AUTOTUNE=0 runs it)
    "fwd": [(128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 8, 3)],
    "dq": [(128, 64, 8, 2), (64, 64, 4, 3), (64, 64, 4, 2), (64, 64, 8, 3)],
    "dkdv": [(64, 128, 8, 2), (32, 64, 4, 3), (64, 64, 4, 3), (32, 128, 4, 3), (32, 64, 8, 3)],
}


def narrowed(kept: list[tuple[int, int, int, int]]):
    """The tuner's pruning: at head dims up to NARROW_D only the `kept` options (when NARROW)."""
    def prune(configs: list, named_args: dict, **kwargs) -> list:
        d = {**named_args, **kwargs}.get("D")
        if not NARROW or d is None or d > NARROW_D:
            return configs
        return [c for c in configs if (c.kwargs["BM"], c.kwargs["BN"], c.num_warps, c.num_stages) in kept]
    return prune


def size_class(n: int) -> int:
    """The SIZE key of n packed tokens: its bit length, at most LARGEST_CLASS."""
    return min(n.bit_length(), LARGEST_CLASS or n.bit_length())

OFFSET_LIMIT = 2**31
"""Past this many elements in q's rows (tokens x row stride) the kernels address q, k, v and their
gradients with 64-bit offsets (WIDE): the 8B shape beyond 2M tokens over SP 4 or 1M over SP 2.
Below it they keep 32-bit address arithmetic, as measured."""


def _wide(q: torch.Tensor, k: torch.Tensor) -> bool:
    return q.shape[0] * max(q.stride(0), k.stride(0)) > OFFSET_LIMIT


def _tuned(kernel, options: list[tuple[int, int, int, int]], tune: bool,
           kept: list[tuple[int, int, int, int]] | None = None):
    """`kernel` autotuned over (BM, BN, warps, stages) `options` (narrowed to `kept` at small head
    dims, where given), or with the first alone. The tuner launches it once per option and repetition on the
    caller's own buffers, so every kernel here must be a pure function of what it reads: none may
    read what it writes. With TUNING_CACHE its choices go to Triton's cache on disk."""
    if INTERPRET or not tune:
        options = options[:1]
    configs = [triton.Config({"BM": bm, "BN": bn}, num_warps=w, num_stages=s) for bm, bn, w, s in options]
    prune = {"early_config_prune": narrowed(kept)} if kept is not None else None
    return triton.autotune(configs, key=KEY, cache_results=TUNING_CACHE, prune_configs_by=prune)(kernel)


def kernels(tune: bool = AUTOTUNE) -> tuple:
    """The forward, dq and dk/dv kernels, autotuned (`tune`) or each in its first configuration."""
    return (_tuned(_fwd_kernel, FWD_OPTIONS, tune, NARROW_OPTIONS["fwd"]),
            _tuned(_dq_kernel, DQ_OPTIONS, tune, NARROW_OPTIONS["dq"]),
            _tuned(_dkdv_kernel, DKDV_OPTIONS, tune, NARROW_OPTIONS["dkdv"]))


_fwd, _dq, _dkdv = kernels()


# ---------------------------------------------------------------------------------------------
# host side

def prepare(log_f: torch.Tensor | None, cu_seqlens: torch.Tensor, n: int,
            heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(Lambda [H, N] in log2 units (zeros without gates), each token's document start and end
    (int32 [N]), kstart and qend without pruning (int32 [H, NB])): one launch, differentiable
    in log_f [N, H]."""
    return _prepare(log_f, cu_seqlens.to(torch.int32), n, heads)


@torch.library.custom_op("longctx::fox_prepare", mutates_args=())
def _prepare(log_f: torch.Tensor | None, cu: torch.Tensor, n: int,
             heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dev = cu.device
    nb = triton.cdiv(n, TILE)
    lam2 = torch.empty(heads, n, dtype=torch.float32, device=dev)
    start, end = (torch.empty(n, dtype=torch.int32, device=dev) for _ in range(2))
    kstart, qend = (torch.empty(heads, nb, dtype=torch.int32, device=dev) for _ in range(2))
    decay = log_f is not None
    _prepare_kernel[(heads,)](
        LOGF=log_f if decay else lam2, CU=cu, LAM=lam2, START=start, END=end, KSTART=kstart, QEND=qend, N=n,
        NB=nb, DOCS=cu.numel() - 1, STEPS=max(1, (cu.numel() - 1).bit_length()), sfn=log_f.stride(0) if decay else 0,
        sfh=log_f.stride(1) if decay else 0, DECAY=decay, BLOCK=_scan_block(n), T=TILE, num_warps=4)
    return lam2, start, end, kstart, qend


@_prepare.register_fake
def _(log_f, cu, n, heads):
    nb = (n + TILE - 1) // TILE
    return (cu.new_empty(heads, n, dtype=torch.float32), cu.new_empty(n), cu.new_empty(n),
            cu.new_empty(heads, nb), cu.new_empty(heads, nb))



@torch.library.custom_op("longctx::fox_dlogf", mutates_args=())
def _dlogf(dlam2: torch.Tensor, end: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    h, n = dlam2.shape
    out = torch.empty(n, h, dtype=dtype, device=dlam2.device)
    _dlogf_kernel[(h,)](DLAM=dlam2.contiguous(), END=end, DLOGF=out, N=n, sfn=out.stride(0), sfh=out.stride(1),
                        BLOCK=_scan_block(n), num_warps=4)
    return out


@_dlogf.register_fake
def _(dlam2, end, dtype):
    return dlam2.new_empty(dlam2.shape[1], dlam2.shape[0], dtype=dtype)


def _prepare_save(ctx, inputs, output):
    log_f = inputs[0]
    ctx.dtype = None if log_f is None else log_f.dtype
    ctx.save_for_backward(output[2])


def _prepare_grads(ctx, dlam2, *_):
    if ctx.dtype is None or dlam2 is None:
        return None, None, None, None
    return _dlogf(dlam2, ctx.saved_tensors[0], ctx.dtype), None, None, None


_prepare.register_autograd(_prepare_grads, setup_context=_prepare_save)


def bounds(lam2: torch.Tensor, delta: torch.Tensor | None,
           start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kstart [H, NB] (first key tile per query tile), qend [H, NB] (first query tile past each
    key tile) and [kept, total] causal tiles within documents per head [H, 2], from Lambda in
    log2 units [H, N] and thresholds in natural units (None: no pruning)."""
    acp = delta is not None
    delta2 = (delta * LOG2E if acp else torch.zeros(lam2.shape[0], device=lam2.device)).float().contiguous()
    return _bounds(lam2, delta2, start, acp)


@torch.library.custom_op("longctx::fox_bounds", mutates_args=())
def _bounds(lam2: torch.Tensor, delta2: torch.Tensor, start: torch.Tensor,
            acp: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    h, n = lam2.shape
    nb = triton.cdiv(n, TILE)
    kstart = torch.empty(h, nb, dtype=torch.int32, device=lam2.device)
    qend = torch.empty_like(kstart)
    tiles = torch.empty(h, 2, dtype=torch.int32, device=lam2.device)
    _bounds_kernel[(h,)](LAM=lam2, DELTA=delta2, START=start, KSTART=kstart, QEND=qend, TILES=tiles, N=n, NB=nb,
                         ACP=acp, T=TILE, num_warps=1)  # a serial walk: one warp is plenty
    return kstart, qend, tiles


@_bounds.register_fake
def _(lam2, delta2, start, acp):
    nb = (lam2.shape[1] + TILE - 1) // TILE
    kstart = lam2.new_empty(lam2.shape[0], nb, dtype=torch.int32)
    return kstart, torch.empty_like(kstart), lam2.new_empty(lam2.shape[0], 2, dtype=torch.int32)


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
    _fwd[lambda meta: (triton.cdiv(n, meta["BM"]), h)](
        Q=q, K=k, V=v, LAM=lam2, START=start, KSTART=kstart, OUT=o, LSE=lse, N=n, NB=kstart.shape[1],
        sq=q.stride(0), sk=k.stride(0), scale=sm_scale * LOG2E, SIZE=size_class(n), GROUPS=h // k.shape[1],
        D=d, T=TILE, PREC=_precision(q), WIDE=_wide(q, k))
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
    nb = kstart.shape[1]
    wide = _wide(q, k)
    delta, row = (torch.empty(h, n, dtype=torch.float32, device=q.device) for _ in range(2))
    _bwd_prep_kernel[(triton.cdiv(n, 64), h)](DO=do, OUT=o, LAM=lam2, LSE=lse, DELTA=delta, ROW=row, N=n,
                                              sq=q.stride(0), D=d, BLOCK=64, WIDE=wide, num_warps=4)
    common = dict(Q=q, K=k, V=v, DO=do, LAM=lam2, ROW=row, DELTA=delta, START=start, N=n, NB=nb, sq=q.stride(0),
                  sk=k.stride(0), scale=sm_scale * LOG2E, sm_scale=sm_scale, SIZE=size_class(n), GROUPS=h // hk,
                  D=d, T=TILE, PREC=_precision(q), WIDE=wide)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    # dLambda (log2 units), from the row and column sums of dS; without the row sums, which
    # vanish in exact arithmetic, the rounding of the bf16 output in delta would pile up in the
    # reverse cumsum to d log f instead of cancelling (it missed the bf16 tolerance on an H200).
    # The column sums get their own buffer: the autotuner launches each kernel many times on the
    # same arguments, so no kernel may read what it writes (when dq added its row sums to dLambda
    # in place, every tuning run added them again: d log f was wrong on each shape's first call)
    dcol, dlam = (torch.empty(h, n, dtype=torch.float32, device=q.device) for _ in range(2))
    _dkdv[lambda meta: (triton.cdiv(n, meta["BN"]), hk)](**common, END=end, QEND=qend, DK=dk, DV=dv, DCOL=dcol)
    dq = torch.empty_like(q)
    _dq[lambda meta: (triton.cdiv(n, meta["BM"]), h)](**common, KSTART=kstart, DCOL=dcol, DQ=dq, DLAM=dlam)
    return dq, dk, dv, dlam


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
    if n * h > 2**31:  # (Lambda and the row statistics, [H, N] fp32, keep 32-bit offsets; q/k/v go WIDE)
        raise ValueError(f"fox attention: {n} tokens x {h} heads overflow the 32-bit offsets of Lambda [heads, "
                         "tokens]; split the heads over ranks (sequence_parallel) or the tokens over sequences")
    sm_scale = d**-0.5 if scale is None else scale
    lam2, start, end, kstart, qend = prepare(log_f, cu_seqlens, n, h)
    tiles = None
    if acp_eps is not None:
        delta = None
        if log_f is not None:
            max_len = (cu_seqlens[1:] - cu_seqlens[:-1]).max()  # stays on the device: no sync per layer
            delta = thresholds(q.detach(), k.detach(), sm_scale, max_len, acp_eps, logit_bound)
        kstart, qend, per_head = bounds(lam2.detach(), delta, start)
        tiles = per_head.sum(0)
    dp = _padded_dim(d)
    q, k, v = (torch.nn.functional.pad(t, (0, dp - d)) if dp != d else t.contiguous() for t in (q, k, v))
    out = _forward(q, k, v, lam2, start, end, kstart, qend, sm_scale)[0]
    return (out[..., :d] if dp != d else out), tiles
