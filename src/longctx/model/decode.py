"""Incremental greedy decoding with a KV cache, for RoPE models and FoX.

A cache holds one document: per layer the (rotated) keys and values, and for FoX the running
cumulative log forget gate of every cached key and the KV-shift's last projections. When the
rotary frequencies change with the length (LongRoPE crossing its original window, dynamic NTK
beyond it) the cached keys are stale, so the cache is rebuilt from the tokens.
"""

from __future__ import annotations

import torch

from .rope import depends_on_length, inverse_frequencies
from .transformer import Transformer


class LayerCache:
    def __init__(self):
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.lam: torch.Tensor | None = None  # [T, H] fp32, FoX only
        self.k_before: torch.Tensor | None = None
        self.v_before: torch.Tensor | None = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_f: torch.Tensor | None,
               backend=None) -> torch.Tensor:
        """Append k, v (and the gates) and attend the new queries over everything cached. The
        prompt (an empty cache) goes through the model's attention backend (`backend`): no
        prompt x prompt score matrix."""
        n = q.shape[0]
        if self.k is None and backend is not None and n > 1:
            self.k, self.v = k, v
            if log_f is not None:
                self.lam = log_f.float().cumsum(0)
            return backend(q, k, v, torch.tensor([0, n], dtype=torch.int32, device=q.device), log_f)
        self.k = k if self.k is None else torch.cat((self.k, k))
        self.v = v if self.v is None else torch.cat((self.v, v))
        total = self.k.shape[0]
        groups = q.shape[1] // k.shape[1]
        acc = torch.promote_types(q.dtype, torch.float32)
        keys = self.k.repeat_interleave(groups, dim=1).to(acc)
        values = self.v.repeat_interleave(groups, dim=1).to(acc)
        logits = torch.einsum("qhd,khd->hqk", q.to(acc), keys) * q.shape[-1] ** -0.5
        if log_f is not None:
            start = self.lam[-1] if self.lam is not None else torch.zeros_like(log_f[0])
            lam_new = start + log_f.cumsum(0)
            self.lam = lam_new if self.lam is None else torch.cat((self.lam, lam_new))
            logits = logits + (lam_new.T[:, :, None] - self.lam.T[:, None, :])
        q_pos = torch.arange(total - n, total, device=q.device)
        allowed = q_pos[:, None] >= torch.arange(total, device=q.device)[None, :]
        probs = logits.masked_fill(~allowed, float("-inf")).softmax(-1)
        return torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)


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
