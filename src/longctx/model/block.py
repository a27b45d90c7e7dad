"""A decoder block: pre-norm attention and a SwiGLU MLP (token-tiled for long sequences), each
with its residual, under the recomputation mode and host offload that training chooses."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from . import fused
from .attention_layer import Attention, Context
from .config import ModelConfig
from .norm import RMSNorm
from .offload import HostOffload
from .recompute import Recompute, recomputed


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
