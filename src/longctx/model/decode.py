"""Incremental greedy decoding with a KV cache, for every position encoding and FoX.

A cache holds one document: per layer the (rotated) keys and values, and for FoX the running
cumulative log forget gate of every cached key and the KV-shift's last projections. When the
rotary frequencies change with the length (LongRoPE crossing its original window, dynamic NTK
beyond it) the cached keys are stale, so the cache is rebuilt from the tokens.
"""

from __future__ import annotations

import os

import torch

from .rope import depends_on_length, inverse_frequencies
from .transformer import Transformer

KERNEL = os.environ.get("LONGCTX_DECODE", "kernel") != "math"
"""On CUDA one new token attends through the Triton decode kernel (fox/decode.py);
LONGCTX_DECODE=math keeps the plain PyTorch path there too (bench/decode.py times both)."""


class LayerCache:
    def __init__(self):
        self.k: torch.Tensor | None = None  # [capacity, Hkv, D]: rows [0, length) are cached
        self.v: torch.Tensor | None = None
        self.lam: torch.Tensor | None = None  # [capacity, H] fp32, FoX only
        self.length = 0
        self.k_before: torch.Tensor | None = None
        self.v_before: torch.Tensor | None = None

    def _append(self, k: torch.Tensor, v: torch.Tensor, lam: torch.Tensor | None) -> None:
        """Write the new rows in place; capacity doubles when full, so a long generation copies
        the cache O(log T) times instead of once per token."""
        end = self.length + k.shape[0]
        if self.k is None or end > self.k.shape[0]:
            capacity = max(end, 2 * (0 if self.k is None else self.k.shape[0]), 256)

            def grown(old: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
                new = like.new_empty(capacity, *like.shape[1:])
                if old is not None:
                    new[: self.length] = old[: self.length]
                return new

            self.k, self.v = grown(self.k, k), grown(self.v, v)
            self.lam = grown(self.lam, lam) if lam is not None else None
        self.k[self.length:end], self.v[self.length:end] = k, v
        if lam is not None:
            self.lam[self.length:end] = lam
        self.length = end

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_f: torch.Tensor | None,
               backend=None, scale: float | None = None) -> torch.Tensor:
        """Append k, v (and the gates) and attend the new queries over everything cached. The
        prompt (an empty cache) goes through the model's attention backend (`backend`): no
        prompt x prompt score matrix. `scale`: the logit scale when queries and keys are wider
        than the values (SeqPE), else 1 / sqrt(head_dim)."""
        n = q.shape[0]
        prompt = self.length == 0 and backend is not None and n > 1
        lam_new = None
        if log_f is not None:
            lam_new = log_f.float().cumsum(0)
            if self.length:
                lam_new = lam_new + self.lam[self.length - 1]
        self._append(k, v, lam_new)
        if prompt:
            return backend(q, k, v, torch.tensor([0, n], dtype=torch.int32, device=q.device), log_f, scale)
        total = self.length
        keys, values = self.k[:total], self.v[:total]
        lam = self.lam[:total] if lam_new is not None else None
        if n == 1 and q.is_cuda and KERNEL and scale is None:
            from .fox.decode import decode_attention

            return decode_attention(q[0], keys, values, None if lam is None else lam_new[0], lam)[None]
        heads, kv_heads = q.shape[1], k.shape[1]
        acc = torch.promote_types(q.dtype, torch.float32)
        # grouped queries against their shared key head: [n, Hkv, G, D] (no per-step copy of the cache)
        grouped = q.to(acc).reshape(n, kv_heads, heads // kv_heads, q.shape[-1])
        logits = torch.einsum("qhgd,khd->hgqk", grouped, keys.to(acc)).reshape(heads, n, total)
        logits = logits * (q.shape[-1] ** -0.5 if scale is None else scale)
        if lam is not None:
            logits = logits + (lam_new.T[:, :, None] - lam.T[:, None, :])
        if n > 1:  # new tokens after the first see the cache and the new ones before them
            q_pos = torch.arange(total - n, total, device=q.device)
            logits = logits.masked_fill(q_pos[:, None] < torch.arange(total, device=q.device)[None, :], float("-inf"))
        probs = logits.softmax(-1).reshape(kv_heads, heads // kv_heads, n, total)
        return torch.einsum("hgqk,khd->qhgd", probs, values.to(acc)).reshape(n, heads, -1).to(q.dtype)


class Cache(list):
    """One LayerCache per layer, and the number of tokens cached."""

    def __init__(self, n_layers: int):
        super().__init__(LayerCache() for _ in range(n_layers))
        self.length = 0
        self.frequencies: torch.Tensor | None = None


def _frequencies(model: Transformer, length: int) -> torch.Tensor | None:
    rope = model.cfg.rope
    if rope is None or not depends_on_length(rope):
        return None
    return inverse_frequencies(rope, model.cfg.dim_head, model.cfg.max_position_embeddings, length)[0]


@torch.no_grad()
def generate(model: Transformer, prompt: torch.Tensor, max_new_tokens: int, eos_id: int | None = None) -> torch.Tensor:
    """Greedy continuation of one prompt [T]; returns prompt + new tokens."""
    tokens = prompt.reshape(-1).clone()
    cache = Cache(model.cfg.n_layers)
    logits = None
    for _ in range(max_new_tokens):
        length = tokens.numel()
        freqs = _frequencies(model, length)
        stale = freqs is not None and cache.frequencies is not None and not torch.equal(freqs, cache.frequencies)
        if stale or cache.length == 0:
            cache = Cache(model.cfg.n_layers)
            logits = model(tokens, cache=cache)
        else:
            logits = model(tokens[-1:], cache=cache)
        cache.frequencies = freqs
        nxt = logits[-1].argmax()
        tokens = torch.cat((tokens, nxt[None]))
        if eos_id is not None and int(nxt) == eos_id:
            break
    return tokens
