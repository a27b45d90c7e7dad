"""The decoder: Llama-style blocks (RMSNorm, SwiGLU, grouped-query attention with RoPE), or
Forgetting Transformer blocks (forget gate, optional QK-norm, output gate and norm, KV-shift).
Other position encodings (positions.py): a learned table added to the token embeddings, ALiBi
(a fixed per-head forget gate), SeqPE (a per-head bias p_q(i).p_k(j) on the logits, carried as
extra query and key dimensions, the values padded alike, so every attention kernel runs it).

Sequences are packed: a batch [B, T] is flattened to N = B*T tokens with document boundaries
`cu_seqlens`, so attention, positions, the forget-gate cumulative sum and the KV-shift all
restart at every document. Parameter names follow HF Llama where the parts coincide.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from . import attention, fused, ulysses
from .config import ModelConfig
from .fox import Acp
from .loss import chunked_cross_entropy
from .offload import HostOffload
from .positions import LearnedTable, SeqPE, alibi_slopes
from .recompute import MODES, Recompute, recomputed
from .rope import cos_sin, depends_on_length, inverse_frequencies, rotate
from .transfer import to_device


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused.wanted(x):
            return fused.kernels().rms_norm(x, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


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
                firsts, lasts = ctx.cu_seqlens[:-1].long(), ctx.cu_seqlens[1:].long() - 1
                k_raw, v_raw = k, v
                k = self.k_shift.mix(k, k_gate, ctx.doc_start, cache.k_before, firsts)
                v = self.v_shift.mix(v, v_gate, ctx.doc_start, cache.v_before, firsts)
                cache.k_before, cache.v_before = k_raw[lasts], v_raw[lasts]
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
        if cache is not None:
            o = cache.attend(q, k, v, log_f, ctx.host, ctx.attend, ctx.scale, last)
        elif ctx.acp_eps is not None:
            o, tiles = attention.fox_pruned(q, k, v, ctx.cu_seqlens, log_f, eps=ctx.acp_eps,
                                            logit_bound=self.logit_bound())
        else:
            o = ctx.attend(q, k, v, ctx.cu_seqlens, log_f, ctx.scale)
        o = o[..., :width]
        return (self.o_norm(o) if self.output_norm else o), tiles

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


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)
        self.tile: int | None = None
        """Tokens per tile (train's `mlp_tile`): the [tokens, ffn_dim] intermediates exist for one
        tile at a time, the backward running each tile's forward again (as ALST's tiled MLP). At
        512K local tokens of the 8B shape each is 14 GiB; untiled, the MLP needs several. (A
        compiled block specialises on the tile count: a stage's packed sequences keep it fixed.)"""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tile is None or x.shape[0] <= self.tile:
            return self._swiglu(x)
        tiles = x.split(self.tile)
        if not torch.is_grad_enabled():
            return torch.cat([self._swiglu(t) for t in tiles])
        return torch.cat([checkpoint(self._swiglu, t, use_reentrant=False) for t in tiles])

    def _swiglu(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(fused.kernels().silu_mul(gate, up) if fused.wanted(x) else F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.self_attn = Attention(cfg, index)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)
        self.recompute: Recompute = "none"
        self.offload: HostOffload | None = None
        """Where full recomputation keeps the block's input (train's `offload_activations`)."""

    def forward(self, x: torch.Tensor, ctx: Context, last: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(output, ACP's tile counts or None): the counts are returned, not recorded, so the
        block has no side effects to trip torch.compile or to count twice when recomputed.
        `last` (decoding, the final block): the output of each document's last new token alone."""
        if last:
            lasts = (ctx.cu_seqlens[1:].long() - 1).clamp(min=0)  # (a document without new tokens: any row)
            a, _ = self.self_attn(self.input_layernorm(x), ctx, lasts)
            return self._mlp_half(x[lasts] + a), None
        if ctx.cache is not None or not torch.is_grad_enabled():
            return self._residual(x, ctx)
        body, mode = (self._halves, "full") if self.recompute == "halves" else (self._residual, self.recompute)
        if self.offload is not None:
            with self.offload.hooks():  # (what the checkpoint saves: the block's input alone)
                return recomputed(body, mode, x, ctx)
        return recomputed(body, mode, x, ctx)

    def _residual(self, x: torch.Tensor, ctx: Context) -> tuple[torch.Tensor, torch.Tensor | None]:
        h, tiles = self._attention_half(x, ctx)
        return self._mlp_half(h), tiles

    def _attention_half(self, x: torch.Tensor, ctx: Context) -> tuple[torch.Tensor, torch.Tensor | None]:
        a, tiles = self.self_attn(self.input_layernorm(x), ctx)
        return x + a, tiles

    def _mlp_half(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mlp(self.post_attention_layernorm(h))

    def _halves(self, x: torch.Tensor, ctx: Context) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The block as `halves` recomputation runs it again in the backward: the attention half
        keeps its input and attention's output alone, so the MLP half's backward, which comes
        first, runs beside those and not beside all the attention half's activations."""
        h, tiles = self._attention_kept(x, ctx)
        return self._mlp_half(h), tiles

    def _attention_kept(self, x: torch.Tensor, ctx: Context) -> tuple[torch.Tensor, torch.Tensor | None]:
        return recomputed(self._attention_half, "attention", x, ctx)


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


def _top_position(host: list[int] | None, cache, given: bool) -> int | None:
    """The largest position of a forward when the host knows it (no device read): the longest
    document's last, with a cache counting what it holds; None when the caller chose the positions."""
    if cache is not None:
        return max(s + b - a for s, a, b in zip(cache.lengths, host[:-1], host[1:], strict=True)) - 1
    if given or host is None:
        return None
    return max(b - a for a, b in zip(host[:-1], host[1:], strict=True)) - 1


def packed_positions(cu_seqlens: torch.Tensor, n: int) -> torch.Tensor:
    """Positions restarting at 0 at every document."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    starts = cu_seqlens[:-1].long().repeat_interleave(lengths, output_size=n)
    return torch.arange(n, device=cu_seqlens.device) - starts


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, attention_backend: str = "auto"):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.learned_positions is not None:
            self.positions = LearnedTable(cfg.learned_positions, cfg.max_position_embeddings, cfg.d_model)
        if cfg.seqpe is not None:
            self.seqpe = SeqPE(cfg.seqpe)
            self.pe_qk = nn.Linear(cfg.seqpe.dim, (cfg.n_heads + cfg.kv_heads) * cfg.dim_head, bias=False)
        self.tie_weights()
        if attention_backend != "auto" and attention_backend not in attention.BACKENDS:
            raise ValueError(f"attention backend {attention_backend!r} is unknown (known: "
                             f"{sorted(attention.BACKENDS)} or 'auto')")
        self.attention_backend = attention_backend
        self.acp: Acp | None = None
        """Adaptive Computation Pruning in FoX attention (the 'fox' backend); stats in acp.stats."""
        self.compiled_loss = False
        """The loss's per-chunk math through torch.compile (set with the compiled blocks, CUDA)."""
        self.sp_group: dist.ProcessGroup | None = None
        """The ranks that share each sequence (Ulysses; train/parallel.sequence_parallel sets it
        and wraps every attention core in the exchanges)."""
        self.reset_parameters()

    def tie_weights(self) -> None:
        """The head shares the embedding matrix (tie_embeddings); again after a load that assigns
        tensors (load_state_dict(assign=True) gives each name its own parameter)."""
        if self.cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def recompute(self) -> Recompute:
        """Activation checkpointing of every block: one of recompute.MODES."""
        return self.layers[0].recompute

    @recompute.setter
    def recompute(self, mode: Recompute) -> None:
        if mode not in MODES:
            raise ValueError(f"activation checkpointing {mode!r} is unknown (known: {MODES})")
        for layer in self.layers:
            layer.recompute = mode

    def reset_parameters(self) -> None:
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if p.dim() == 2:
                # output projections scaled by depth, as GPT-2 / nanoGPT
                deep = name.endswith(("o_proj.weight", "down_proj.weight"))
                scale = 1 / math.sqrt(2 * self.cfg.n_layers) if deep else 1
                nn.init.normal_(p, mean=0.0, std=std * scale)
            elif name.endswith("fgate.bias"):
                # forget gates start spread over heads from fast (sigmoid 1 = 0.73) to slow decay
                # (sigmoid 6 = 0.998), so some heads look far from the first step (our choice)
                with torch.no_grad():
                    p.copy_(torch.linspace(1.0, 6.0, p.numel()))
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            else:
                nn.init.ones_(p)

    def rotary(self, position_ids: torch.Tensor, cu_seqlens: torch.Tensor, dtype: torch.dtype):
        """cos, sin [1, N, head_dim]. Length-dependent scalings (LongRoPE's short/long factors,
        dynamic NTK) are chosen per document by its current length, so a packed short document
        keeps the original RoPE next to a long one (LongRoPE2's mixed context window)."""
        rope, cfg = self.cfg.rope, self.cfg
        if rope is None:
            return None, None
        if not depends_on_length(rope):
            inv, scale = inverse_frequencies(rope, cfg.dim_head, cfg.max_position_embeddings)
            cos, sin = cos_sin(inv, scale, position_ids, dtype)
            return cos[None], sin[None]
        doc_len = position_ids[cu_seqlens[1:].long() - 1] + 1
        distinct, which = torch.unique(doc_len, return_inverse=True)
        tables = [inverse_frequencies(rope, cfg.dim_head, cfg.max_position_embeddings, int(n)) for n in distinct]
        inv = torch.stack([t[0] for t in tables]).to(position_ids.device)
        per_token = inv[which.repeat_interleave((cu_seqlens[1:] - cu_seqlens[:-1]).long())]
        # the attention factor does not depend on the length
        cos, sin = cos_sin(per_token, tables[0][1], position_ids, dtype)
        return cos[None], sin[None]

    def hidden(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor | list[int] | None = None,
               position_ids: torch.Tensor | None = None, cache=None, last: bool = False) -> torch.Tensor:
        """Final hidden states [N, d_model] for packed ids [N] (or a batch [B, T], flattened).
        `cu_seqlens` may be on the host (a list, or a CPU tensor where no FSDP root moves it):
        backends that size kernels or route documents by length then read it there, with no sync.
        With a `decode.Cache`, ids continue the documents the cache holds (`cu_seqlens`: how many
        new tokens each; default all for one document, else one each). Under sequence
        parallelism (`sp_group`, set by train/parallel.py), every rank passes the whole
        micro-batch and gets the hidden states of its own slice, `ulysses.bounds(N, sp_group)`.
        `last` (with a cache): only each document's last new token's, [docs, d_model] (the final
        block attends and runs its MLP for those rows alone: a prefill needs no more for its
        next-token logits, and the cache takes every row's keys before that block's attention)."""
        if last and cache is None:
            raise ValueError("last: each document's last hidden state is for decoding with a cache")
        ids = input_ids.reshape(-1)
        n, device = ids.numel(), ids.device
        position_ids_given = position_ids is not None
        if cache is not None:
            if self.sp_group is not None:
                raise ValueError("decoding with a cache runs without sequence parallelism")
            bounds = cache.bounds(n, cu_seqlens)
            cu_seqlens = torch.tensor(bounds, dtype=torch.int32)
            sizes = torch.tensor([b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)], device=device)
            position_ids = (packed_positions(cu_seqlens.to(device), n)
                            + torch.tensor(cache.lengths, device=device).repeat_interleave(sizes, output_size=n))
        if cu_seqlens is None:
            cu_seqlens = torch.arange(0, n + 1, input_ids.shape[-1], dtype=torch.int32)
        if isinstance(cu_seqlens, (list, tuple)):
            cu_seqlens = torch.tensor(cu_seqlens, dtype=torch.int32)
        host = cu_seqlens.tolist() if cu_seqlens.device.type == "cpu" else None
        cu_seqlens = to_device(cu_seqlens, device, torch.int32)
        if position_ids is None:
            position_ids = (packed_positions(cu_seqlens, n) if self.cfg.reset_position_ids
                            else torch.arange(n, device=device) % input_ids.shape[-1])
        lo, hi = ulysses.bounds(n, self.sp_group)
        x = self.embed_tokens(ids[lo:hi])
        cos, sin = self.rotary(position_ids.reshape(-1), cu_seqlens, x.dtype)
        top = _top_position(host, cache, position_ids_given or not self.cfg.reset_position_ids)
        if self.cfg.learned_positions is not None:
            x = x + self.positions(position_ids.reshape(-1)[lo:hi], top)
        pe = self._seqpe(position_ids.reshape(-1), top) if self.cfg.seqpe is not None else None
        ctx = self.attention_context(cu_seqlens, n, cos, sin, host, cache, pe)
        tiles = []
        for i, layer in enumerate(self.layers):
            x, counts = layer(x, ctx, last and i == len(self.layers) - 1)
            if counts is not None:
                tiles.append(counts)
        if tiles:
            self.acp.stats.add(*torch.stack(tiles).sum(0))
        if cache is not None:
            cache.lengths = [s + b - a for s, a, b in zip(cache.lengths, host[:-1], host[1:], strict=True)]
        return self.norm(x)

    def attention_context(self, cu_seqlens: torch.Tensor, n: int, cos, sin, host: list[int] | None, cache=None,
                          pe: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> Context:
        """What every layer of a forward over these documents (device boundaries `cu_seqlens`, or
        also `host` ones) shares: the backend, checked against ACP and bound to its plan when the
        host knows the boundaries, the rotary tables, ACP's threshold, SeqPE's parts."""
        device = cu_seqlens.device
        name = attention.resolve(self.attention_backend, device, self.cfg.fox is not None or self.cfg.alibi)
        if self.acp is not None and name != "fox":
            raise ValueError("ACP prunes FoX attention with the 'fox' attention backend (Triton, CUDA); this "
                             f"model is {'FoX' if self.cfg.fox else 'not FoX'} and attends with {name!r} on "
                             f"{device.type}")
        attend = attention.BACKENDS[name]
        sp = dist.get_world_size(self.sp_group) if self.sp_group is not None else 1
        width = self.cfg.n_heads // sp * self.cfg.dim_head
        plan = attention.plan(name, host, device, width) if host is not None else None
        if plan is not None:
            attend = functools.partial(attend, plan=plan)
        acp_eps = self.acp.eps if self.acp is not None and cache is None else None
        return Context(cu_seqlens, n, cos, sin, attend, cache, acp_eps, pe, host)

    def _seqpe(self, positions: torch.Tensor, top: int | None) -> tuple[torch.Tensor, torch.Tensor, float]:
        """SeqPE's per-token query and key parts, from one encoding per distinct position."""
        if self.sp_group is not None:
            raise ValueError("SeqPE models train without sequence parallelism (the position bias is not split "
                             "over ranks); set sequence_parallel: 1")
        distinct, which = torch.unique(positions, return_inverse=True)
        parts = self.pe_qk(self.seqpe(distinct, top))[which]
        h, hk, d = self.cfg.n_heads, self.cfg.kv_heads, self.cfg.dim_head
        return parts[:, : h * d].view(-1, h, d), parts[:, h * d:].view(-1, hk, d), d**-0.5

    def forward(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor | list[int] | None = None,
                position_ids: torch.Tensor | None = None, cache=None,
                labels: torch.Tensor | None = None, loss_chunk: int = 2048) -> torch.Tensor:
        """Logits [N, vocab]; or, given labels [N] (IGNORE where no loss), the summed next-token
        loss of this rank's tokens, computed in chunks so N x vocab logits never exist. The loss
        goes through forward (not `hidden` + the head outside) so that FSDP gathers the head."""
        hidden = self.hidden(input_ids, cu_seqlens, position_ids, cache)
        if labels is None:
            return self.lm_head(hidden)
        lo, hi = ulysses.bounds(labels.numel(), self.sp_group)
        labels = to_device(labels.reshape(-1)[lo:hi], hidden.device)
        return chunked_cross_entropy(hidden, self.lm_head.weight, labels, loss_chunk, compiled=self.compiled_loss)
