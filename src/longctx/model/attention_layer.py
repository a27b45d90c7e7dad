"""A block's attention: per-token projections (q, k, v; FoX's forget gate and KV-shift), the
part over whole documents per head (KV-shift's mix, QK norms, RoPE, SeqPE's extra dimensions, the
backend's kernel or a decoding cache), then the output gate and projection. Context is what every
layer of one forward shares."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from . import attention, fused
from .config import ModelConfig
from .norm import RMSNorm
from .positions import alibi_slopes
from .rope import rotate

Heads = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]
"""Attention's per-token projections: q, k, v, log forget gates, KV-shift's k and v gates."""


class ShiftLinear(nn.Module):
    """FoX (Pro) KV-shift: y_t = a_t * W x_{t-1} + (1 - a_t) * W x_t, a_t = sigmoid(w . x_t) per
    head; at a document start the previous token is taken as zero. Split in a per-token part
    (`project`) and a per-head part over the whole sequence (`mix`), so that under sequence
    parallelism the shift runs after the exchange and never needs a neighbour rank's token."""

    def __init__(self, d_model: int, heads: int, head_dim: int):
        super().__init__()
        self.proj = nn.Linear(d_model, heads * head_dim, bias=False)
        self.alpha = nn.Linear(d_model, heads, bias=False)
        self.heads, self.head_dim = heads, head_dim

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(W x [N, heads, head_dim], a [N, heads, 1])."""
        return self.proj(x).view(-1, self.heads, self.head_dim), torch.sigmoid(self.alpha(x)).unsqueeze(-1)

    @staticmethod
    def mix(y: torch.Tensor, a: torch.Tensor, doc_start: torch.Tensor, before: torch.Tensor | None = None,
            firsts: torch.Tensor | None = None) -> torch.Tensor:
        """Shifted [N, heads, head_dim]. `before` [docs, heads, head_dim]: W x of the token that
        precedes each document's first new token, at rows `firsts` (decoding with a cache), else
        zero."""
        prev = torch.cat((torch.zeros_like(y[:1]), y[:-1]), dim=0).masked_fill(doc_start[:, None, None], 0.0)
        if before is not None:
            prev = prev.index_copy(0, firsts, before.to(prev.dtype))
        return a * prev + (1 - a) * y


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        h, hk, d = cfg.n_heads, cfg.kv_heads, cfg.dim_head
        self.h, self.hk, self.d = h, hk, d
        self.index = index
        # the FoX switches as plain bools: compiled code never reads the config object
        fox = cfg.fox
        self.forget_gate = fox is not None
        self.kv_shift, self.qk_norm, self.output_gate, self.output_norm = (
            bool(fox and getattr(fox, name)) for name in ("kv_shift", "qk_norm", "output_gate", "output_norm"))
        self.q_proj = nn.Linear(cfg.d_model, h * d, bias=cfg.attention_bias)
        if self.kv_shift:
            self.k_shift = ShiftLinear(cfg.d_model, hk, d)
            self.v_shift = ShiftLinear(cfg.d_model, hk, d)
        else:
            self.k_proj = nn.Linear(cfg.d_model, hk * d, bias=cfg.attention_bias)
            self.v_proj = nn.Linear(cfg.d_model, hk * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(h * d, cfg.d_model, bias=False)
        if self.forget_gate:
            self.fgate = nn.Linear(cfg.d_model, h, bias=True)
        if self.qk_norm:
            self.q_norm = RMSNorm(d, cfg.norm_eps)
            self.k_norm = RMSNorm(d, cfg.norm_eps)
        if self.output_gate:
            self.ogate = nn.Linear(cfg.d_model, h * d, bias=False)
        if self.output_norm:
            self.o_norm = RMSNorm(d, cfg.norm_eps)
        if cfg.alibi:  # log f = -m_h at every token: the decay m_h (i - j)
            self.register_buffer("alibi", -alibi_slopes(h), persistent=False)
        self.use_alibi = cfg.alibi

    def forward(self, x: torch.Tensor, ctx: Context,
                lasts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(output, ACP's [kept, total] tiles or None): per-token projections, then the part that
        needs whole documents, per head (sequence parallelism wraps it in its exchanges:
        train/parallel.py), then the per-token output. `lasts` (decoding): the output of these
        rows alone, each document's last new token (`decode.LayerCache.attend`'s `last`)."""
        o, tiles = self.core(*self.project(x), ctx, last=lasts is not None)
        if lasts is not None:
            x = x[lasts]
        return self.output(o.reshape(x.shape[0], self.h * self.d), x), tiles

    def project(self, x: torch.Tensor) -> Heads:
        """q, k, v [N, heads, head_dim], FoX's log forget gates [N, h] and KV-shift's gates."""
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.h, self.d)
        if self.kv_shift:
            (k, k_gate), (v, v_gate) = self.k_shift.project(x), self.v_shift.project(x)
        else:
            k = self.k_proj(x).view(n, self.hk, self.d)
            v = self.v_proj(x).view(n, self.hk, self.d)
            k_gate = v_gate = None
        log_f = F.logsigmoid(self.fgate(x).float()) if self.forget_gate else None
        if self.use_alibi:
            log_f = self.alibi.expand(n, self.h)
        return q, k, v, log_f, k_gate, v_gate

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_f: torch.Tensor | None,
             k_gate: torch.Tensor | None, v_gate: torch.Tensor | None,
             ctx: Context, last: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """KV-shift, QK norms, RoPE, attention and the output norm over whole documents, per
        head: (o [N, heads, head_dim], ACP's tiles or None)."""
        cache = ctx.cache[self.index] if ctx.cache is not None else None
        if self.kv_shift:
            if cache is None:
                k, v = self.k_shift.mix(k, k_gate, ctx.doc_start), self.v_shift.mix(v, v_gate, ctx.doc_start)
            else:  # each document goes on from its last cached token's projections
                firsts = ctx.cu_seqlens[:-1].long()
                k_raw, v_raw = k, v
                k = self.k_shift.mix(k, k_gate, ctx.doc_start, cache.k_before, firsts)
                v = self.v_shift.mix(v, v_gate, ctx.doc_start, cache.v_before, firsts)
                cache.shift(k_raw, v_raw, ctx.cache.step)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if ctx.cos is not None and fused.wanted(q):
            q, k = (fused.kernels().rotate(t, ctx.cos, ctx.sin, v.dtype) for t in (q, k))
        elif ctx.cos is not None:
            q = rotate(q.transpose(0, 1), ctx.cos, ctx.sin).transpose(0, 1)
            k = rotate(k.transpose(0, 1), ctx.cos, ctx.sin).transpose(0, 1)
        width = v.shape[-1]
        if ctx.pe_q is not None:
            # SeqPE: q.k + p_q.p_k at the heads' own 1 / sqrt(d); the values padded with zeros to
            # the same width (every kernel takes one head size), the padding dropped after
            q = torch.cat((q, ctx.pe_q.to(q.dtype)), dim=-1)
            k = torch.cat((k, ctx.pe_k.to(k.dtype)), dim=-1)
            v = F.pad(v, (0, ctx.pe_q.shape[-1]))
        # one dtype for the kernels: under autocast, RoPE tables and norms come out in fp32
        q, k = q.to(v.dtype), k.to(v.dtype)
        tiles = None
        if cache is not None:  # (with ACP, prompts into an empty cache prefill pruned, their tiles counted)
            counted: list[torch.Tensor] = []
            backend = ctx.attend if ctx.acp_eps is None else functools.partial(self._pruned, ctx.acp_eps, counted)
            o = cache.attend(q, k, v, log_f, ctx.cache.step, backend, ctx.scale, last)
            tiles = counted[0] if counted else None
        elif ctx.acp_eps is not None:
            o, tiles = attention.fox_pruned(q, k, v, ctx.cu_seqlens, log_f, eps=ctx.acp_eps,
                                            logit_bound=self.logit_bound())
        else:
            o = ctx.attend(q, k, v, ctx.cu_seqlens, log_f, ctx.scale)
        o = o[..., :width]
        return (self.o_norm(o) if self.output_norm else o), tiles

    def _pruned(self, eps: float, counted: list, q, k, v, cu_seqlens, log_f, scale) -> torch.Tensor:
        """The cache's prefill backend under ACP: the 'fox' kernel's output, its tile counts kept."""
        o, counts = attention.fox_pruned(q, k, v, cu_seqlens, log_f, eps=eps, logit_bound=self.logit_bound())
        counted.append(counts)
        return o

    def output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The output gate (FoX (Pro), from the block's input x) and projection, per token."""
        if self.output_gate:
            o = o * torch.sigmoid(self.ogate(x))
        return self.o_proj(o)

    def logit_bound(self) -> torch.Tensor | None:
        """U for ACP: with QK-norm |q.k| / sqrt(d) <= max|g_q| max|g_k| sqrt(d); without it None
        (the kernel bounds it by the largest norms of q and k)."""
        if not self.qk_norm:
            return None
        gains = self.q_norm.weight.detach().abs().max() * self.k_norm.weight.detach().abs().max()
        return gains.float() * self.d**0.5


class Context:
    """What every layer of one forward pass shares: boundaries, rotary tables, the backend (its
    plan bound), and when decoding, the per-layer caches (the new tokens continue the cache's
    documents, one each). Boundaries (`host`: on the host too, when known), tables and document
    starts cover all n tokens, also under sequence parallelism."""

    def __init__(self, cu_seqlens: torch.Tensor, n: int, cos, sin, attend, cache=None,
                 acp_eps: float | None = None, pe: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                 host: list[int] | None = None):
        self.cu_seqlens, self.host = cu_seqlens, host
        self.pe_q, self.pe_k, self.scale = pe if pe is not None else (None, None, None)
        """SeqPE's per-token query and key parts [N, heads, head_dim] and the logit scale."""
        self.acp_eps = acp_eps
        self.cos, self.sin = cos, sin
        self.attend = attend
        self.cache = cache
        self.doc_start = torch.zeros(n, dtype=torch.bool, device=cu_seqlens.device)
        if cache is None or not any(cache.lengths):  # index_fill: a host scalar `True` would be a copy and a sync
            self.doc_start.index_fill_(0, cu_seqlens[:-1].long(), True)
