"""The decoder: Llama-style blocks (RMSNorm, SwiGLU, grouped-query attention with RoPE), or
Forgetting Transformer blocks (forget gate, optional QK-norm, output gate and norm, KV-shift).
Other position encodings (positions.py): a learned table added to the token embeddings, ALiBi
(a fixed per-head forget gate), SeqPE (a per-head bias p_q(i).p_k(j) on the logits, carried as
extra query and key dimensions, the values padded alike, so every attention kernel runs it).

Sequences are packed: a batch [B, T] is flattened to N = B*T tokens with document boundaries
`cu_seqlens`, so attention, positions, the forget-gate cumulative sum and the KV-shift all
restart at every document. Parameter names follow HF Llama where the parts coincide. The
blocks are in block.py, their attention in attention_layer.py, the kernels it runs in attention.py.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
from torch import nn

from . import attention, ulysses
from .attention_layer import Context
from .block import Block
from .config import ModelConfig
from .fox import Acp
from .loss import chunked_cross_entropy
from .norm import RMSNorm
from .positions import LearnedTable, SeqPE
from .recompute import MODES, Recompute
from .rope import cos_sin, depends_on_length, inverse_frequencies
from .transfer import to_device


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
        """Adaptive Computation Pruning in FoX attention (the 'fox' backend); stats in acp.stats. With a
        KV cache it prunes the prompts' prefill (decode steps read every cached key)."""
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
        if cache is not None:  # each new token's row in the cache is its position (one pinned copy: no sync)
            if self.sp_group is not None:
                raise ValueError("decoding with a cache runs without sequence parallelism")
            step = cache.begin(n, cu_seqlens, device)
            host, cu_seqlens, position_ids = step.bounds, step.cu, step.row
        else:
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
        acp_eps = self.acp.eps if self.acp is not None else None
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
