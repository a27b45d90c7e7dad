"""Document-masked causal attention over packed sequences, with the FoX forget-gate decay.

Inputs are packed: q [N, H, D], k and v [N, Hkv, D] for N tokens of several documents back to
back, `cu_seqlens` [n_docs + 1] int32 their boundaries. Attention never crosses a boundary.
FoX adds D_ij = Lambda_i - Lambda_j to the logits, Lambda the per-document cumulative sum of
log forget gates (fp32), unscaled by 1/sqrt(d).

Backends (one signature, chosen by `select`):
  reference   explicit softmax in fp32; every feature, any device. The ground truth for tests.
  sdpa        PyTorch's scaled_dot_product_attention per document: its flash / memory-efficient
              kernels for plain causal attention, an additive bias for FoX. Any device.
  cudnn       cuDNN's fused kernel per long document, FlashAttention-2 for the short ones
              (cudnn_attention.py; CUDA, the default for plain attention on Hopper); no FoX.
  flash_attn  flash_attn_varlen_func (CUDA, when flash-attn is installed); no FoX.
  varlen      torch.nn.attention.varlen.varlen_attn, PyTorch's built-in flash path (CUDA); no FoX.
  flex        FlexAttention with a document block mask and the FoX decay as a score_mod (CUDA).
  fox         our Triton kernel (fox/kernel.py): FoX decay, documents, GQA, and Adaptive
              Computation Pruning when given an `Acp` (CUDA; the default for FoX there).

Backends that need the document lengths on the host (the flash kernels size their grids by the
longest; 'cudnn' routes each document) take a `plan`, made once per forward by `plan` from
boundaries the caller holds on the host; without one they read the boundaries off the device.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F

from . import cudnn_attention
from .config import ATTENTION_BACKENDS, head_dim_refused
from .fox import INTERPRET, Acp, doc_cumsum, doc_ids, reference

AttentionFn = Callable[..., torch.Tensor]


GROUP_TOKENS = 256  # measured on CPU: per-call overhead vs wasted masked work


def _groups(bounds: list[int]) -> list[tuple[int, int, bool]]:
    """Runs of consecutive documents of at most GROUP_TOKENS tokens (a longer document alone):
    (start, stop, holds several documents). One kernel call per run instead of per document."""
    out, start, docs = [], bounds[0], 1
    for prev, end in zip(bounds[1:-1], bounds[2:], strict=True):
        if end - start > GROUP_TOKENS:
            out.append((start, prev, docs > 1))
            start, docs = prev, 0
        docs += 1
    out.append((start, bounds[-1], docs > 1))
    return out


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
         log_f: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]
    lam = doc_cumsum(log_f, cu_seqlens) if log_f is not None else None
    bounds = cu_seqlens.tolist()
    doc = doc_ids(cu_seqlens, q.shape[0]) if len(bounds) > 2 else None
    runs = _groups(bounds)
    sizes = [b - a for a, b, _ in runs]
    # split and cat, not slicing and index assignment: each slice's backward filled a zero tensor
    # of the whole sequence (on the tiny CPU base, a fifth of a step's time)
    qs, ks, vs = (t.split(sizes) for t in (q, k, v))
    lams = lam.split(sizes) if lam is not None else None
    out = []
    for i, (a, b, several) in enumerate(runs):
        qd, kd, vd = (t[i].transpose(0, 1)[None] for t in (qs, ks, vs))  # [1, H, L, D]: 4-D for the flash kernels
        if lam is None and not several:
            o = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale, enable_gqa=groups > 1)
        else:
            allowed = torch.ones(b - a, b - a, dtype=torch.bool, device=q.device).tril()
            if several:
                allowed &= doc[a:b, None] == doc[None, a:b]
            if lam is None:
                mask = allowed
            else:
                ld = lams[i].T  # [H, L]
                mask = (ld[:, :, None] - ld[:, None, :]).masked_fill(~allowed, float("-inf")).to(q.dtype)
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale, enable_gqa=groups > 1)
        out.append(o[0].transpose(0, 1))
    return torch.cat(out)


def _flash_only(name: str, q: torch.Tensor, log_f: torch.Tensor | None) -> None:
    """What the flash kernels cannot do, said before they are called."""
    if log_f is not None:
        raise ValueError(f"attention backend {name!r} has no forget-gate decay; for FoX use 'fox' or 'flex' on CUDA "
                         "or 'sdpa' / 'reference' anywhere")
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"attention backend {name!r} takes float16/bfloat16, got {q.dtype}; "
                         "use 'sdpa' or 'flex' (or autocast)")
    if why := head_dim_refused(name, q.shape[-1]):
        raise ValueError(f"attention backend {name!r} {why}, got {q.shape[-1]}; use 'sdpa' or 'flex'")


def _max_len(bounds: list[int]) -> int:
    return max(b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True))


def flash_attn(q, k, v, cu_seqlens, log_f=None, scale=None, plan: int | None = None):
    _flash_only("flash_attn", q, log_f)
    from flash_attn import flash_attn_varlen_func

    n = plan if plan is not None else _max_len(cu_seqlens.tolist())
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, n, n, softmax_scale=scale, causal=True)


@functools.cache
def _varlen_gqa() -> bool:
    from torch.nn.attention.varlen import varlen_attn

    return "enable_gqa" in inspect.signature(varlen_attn).parameters  # torch >= 2.12


def varlen(q, k, v, cu_seqlens, log_f=None, scale=None, plan: int | None = None):
    """`plan`: the longest document's length."""
    _flash_only("varlen", q, log_f)
    from torch.nn.attention.varlen import varlen_attn

    extra = {}
    if k.shape[1] != q.shape[1]:
        if _varlen_gqa():
            extra["enable_gqa"] = True
        else:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    n = plan if plan is not None else _max_len(cu_seqlens.tolist())
    # window (-1, 0) is causal attention (torch 2.11 has no is_causal here)
    return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, n, n, scale=scale, window_size=(-1, 0), **extra)


def cudnn(q, k, v, cu_seqlens, log_f=None, scale=None, plan: cudnn_attention.Plan | None = None):
    _flash_only("cudnn", q, log_f)
    return cudnn_attention.attend(q, k, v, cu_seqlens, plan, scale)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    # compiled block-mask construction never materializes the dense N x N mask
    return torch.compile(flex_attention, dynamic=False), torch.compile(create_block_mask)


FLEX_BUCKET = 2048
"""Flex kernels are compiled per length; other lengths (prompts) are padded up to a multiple of
this, the padding being one more document, so a few compilations serve every length."""


def flex(q, k, v, cu_seqlens, log_f=None, scale=None):
    n = q.shape[0]
    if pad := -n % FLEX_BUCKET:
        def grow(t):
            return torch.cat((t, t.new_zeros(pad, *t.shape[1:])))

        cu = torch.cat((cu_seqlens, cu_seqlens.new_tensor([n + pad])))
        out = _flex(grow(q), grow(k), grow(v), cu, None if log_f is None else grow(log_f), scale)
        return out[:n]
    return _flex(q, k, v, cu_seqlens, log_f, scale)


def _flex(q, k, v, cu_seqlens, log_f=None, scale=None):
    attend, block_mask_of = _compiled_flex()
    n = q.shape[0]
    doc = doc_ids(cu_seqlens, n)

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    block_mask = block_mask_of(mask_mod, 1, 1, n, n, device=q.device)
    score_mod = None
    if log_f is not None:
        lam = doc_cumsum(log_f, cu_seqlens).T.contiguous()  # [H, N] fp32
        lam_k = lam.clone()  # flex refuses to index one grad-requiring tensor twice

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + (lam[h, q_idx] - lam_k[h, kv_idx])

    out = attend(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                           score_mod=score_mod, block_mask=block_mask, scale=scale,
                           enable_gqa=k.shape[1] != q.shape[1])
    return out[0].transpose(0, 1)


def fox(q, k, v, cu_seqlens, log_f=None, scale=None, acp: Acp | None = None, logit_bound=None):
    """The Triton kernel, imported on first use: only this backend needs Triton."""
    from .fox.kernel import fox_attention

    return fox_attention(q, k, v, cu_seqlens, log_f, scale, acp=acp, logit_bound=logit_bound)


def fox_pruned(q, k, v, cu_seqlens, log_f, *, eps: float, logit_bound=None):
    """The 'fox' kernel with ACP and no side effects (what compiled code calls): (out, [kept,
    total] causal tiles), the counts for the caller to add to its `AcpStats`."""
    from .fox.kernel import attend

    return attend(q, k, v, cu_seqlens, log_f, acp_eps=eps, logit_bound=logit_bound)


BACKENDS: dict[str, AttentionFn] = {"reference": reference, "sdpa": sdpa, "cudnn": cudnn, "flash_attn": flash_attn,
                                    "varlen": varlen, "flex": flex, "fox": fox}
assert tuple(BACKENDS) == ATTENTION_BACKENDS, "model/config.py's ATTENTION_BACKENDS must name these backends"
PLAIN_ONLY = ("cudnn", "flash_attn", "varlen")
"""Backends without the forget gate."""


def plan(name: str, bounds: list[int], device: torch.device, width: int):
    """What backend `name` needs to know of the documents (host boundaries `bounds`) for attention
    of `width` = heads x head dim (a rank's heads), or None."""
    if name == "cudnn":
        return cudnn_attention.plan(bounds, device, width)
    if name in ("flash_attn", "varlen"):
        return _max_len(bounds)
    return None


def available(device: torch.device) -> list[str]:
    names = ["reference", "sdpa"]
    if importlib.util.find_spec("triton") is not None and (device.type == "cuda" or INTERPRET):
        names.append("fox")
    if device.type == "cuda":
        names.append("flex")
        if torch.cuda.get_device_capability(device) >= (8, 0) and (torch.backends.cudnn.version() or 0) >= 90000:
            names.append("cudnn")
        if importlib.util.find_spec("torch.nn.attention.varlen") is not None:
            names.append("varlen")
        if importlib.util.find_spec("flash_attn") is not None:
            names.append("flash_attn")
    return names


def resolve(name: str, device: torch.device, fox: bool) -> str:
    """The backend for a config value, checked against the device and the model (`fox`: a decay,
    FoX's or ALiBi's): a name from BACKENDS, or "auto" for the fastest that can run it (cuDNN's
    kernel on Hopper: 1.6x FlashAttention-2's speed at 16K and 64K, bench/attention.py). Its wrong
    gradients of issue 32 were PyTorch's graph cache shared with F.sdpa's own cuDNN path in one
    process (cudnn_attention._private); the wrapper now matches FlashAttention-2 on a trained
    model after sdpa's step (tests/test_gpu_attention.py)."""
    here = available(device)
    if name == "auto":
        if device.type != "cuda":
            return "sdpa"
        if fox:
            return "fox" if "fox" in here else "flex"
        hopper = torch.cuda.get_device_capability(device) >= (9, 0)
        for fast in ("cudnn", "flash_attn", "varlen") if hopper else ("flash_attn", "varlen"):
            if fast in here:
                return fast
        return "sdpa"
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r} is unknown (known: {sorted(BACKENDS)}; on {device.type}: {here})")
    if name not in here:
        raise ValueError(f"attention backend {name!r} cannot run on {device.type} here; use one of {here}")
    if fox and name in PLAIN_ONLY:
        raise ValueError(f"attention backend {name!r} has no decay (FoX's forget gate, ALiBi); for those use "
                         f"{[b for b in here if b not in PLAIN_ONLY]}")
    return name


def select(name: str, device: torch.device, fox: bool) -> AttentionFn:
    return BACKENDS[resolve(name, device, fox)]
