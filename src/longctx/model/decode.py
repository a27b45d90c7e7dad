"""Incremental greedy decoding with a KV cache, for every position encoding and FoX, several
documents at once.

A cache holds B documents side by side: per layer the (rotated) keys and values in rows
[b, 0, length_b), and for FoX the running cumulative log forget gate of every cached key and the
KV-shift's last projections. The prompts are prefilled packed, through the model's attention
backend (the training path: documents masked from each other, no prompt x prompt score matrix);
then every unfinished document takes one token a step, so a step costs one forward for all of
them. When the rotary frequencies change with the length (LongRoPE crossing its original
window, dynamic NTK beyond it) the cached keys are stale, so the cache is rebuilt from the tokens.
"""

from __future__ import annotations

import os

import torch

from .rope import depends_on_length, inverse_frequencies
from .transformer import Transformer

KERNEL = os.environ.get("LONGCTX_DECODE", "kernel") != "math"
"""On CUDA one new token attends through the Triton decode kernel (fox/decode.py);
LONGCTX_DECODE=math keeps the plain PyTorch path there too (bench/decode.py times both)."""


def attend_cached(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lam_q: torch.Tensor | None,
                  lam_k: torch.Tensor | None, q_pos: torch.Tensor, scale: float) -> torch.Tensor:
    """Queries q [B, n, H, D] at positions q_pos [B, n] over cached keys, values [B, T, Hkv, D]:
    a query sees the keys at positions up to its own (the rows past a document's length are
    masked with them). FoX adds lam_q [B, n, H] - lam_k [B, T, H]. Grouped queries attend their
    shared key head through a reshape (no copy of the cache)."""
    b, n, heads, d = q.shape
    t, kv_heads = keys.shape[1], keys.shape[2]
    g = heads // kv_heads
    acc = torch.promote_types(q.dtype, torch.float32)
    grouped = q.to(acc).reshape(b, n, kv_heads, g, d)
    logits = torch.einsum("bqhgd,bkhd->bhgqk", grouped, keys.to(acc)) * scale
    if lam_q is not None:
        logits = logits + (lam_q.transpose(1, 2).reshape(b, kv_heads, g, n, 1)
                           - lam_k.transpose(1, 2).reshape(b, kv_heads, g, 1, t))
    hidden = torch.arange(t, device=q.device)[None, None, :] > q_pos[:, :, None]
    probs = logits.masked_fill(hidden[:, None, None], float("-inf")).softmax(-1)
    return torch.einsum("bhgqk,bkhd->bqhgd", probs, values.to(acc)).reshape(b, n, heads, -1).to(q.dtype)


class LayerCache:
    """One layer's keys, values (and FoX gates) of B documents, padded to a shared capacity."""

    def __init__(self, docs: int = 1, reserve: int = 0):
        self.reserve = reserve  # rows a document will still take after its prompt (its answer's tokens)
        self.k: torch.Tensor | None = None  # [B, capacity, Hkv, D]: rows [b, 0, lengths[b]) are cached
        self.v: torch.Tensor | None = None
        self.lam: torch.Tensor | None = None  # [B, capacity, H] fp32, FoX only
        self.lengths = [0] * docs
        self.k_before: torch.Tensor | None = None  # [B, Hkv, D]: KV-shift's W x of each document's last token
        self.v_before: torch.Tensor | None = None

    def _grow(self, end: int, k: torch.Tensor, v: torch.Tensor, lam: torch.Tensor | None) -> None:
        """Room for `end` rows a document: the prompt's and the reserved answer's at first, then
        capacity doubles when full, so a long generation copies the cache O(log T) times instead
        of once per token (and a 64K prompt's cache is not doubled for its answer's few tokens).
        New rows are zeros: the masked padding of shorter documents must not hold NaNs."""
        if self.k is not None and end <= self.k.shape[1]:
            return
        old = 0 if self.k is None else self.k.shape[1]
        capacity = max(end + self.reserve, 256) if old == 0 else max(end, 2 * old)

        def grown(buf: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
            new = like.new_zeros(len(self.lengths), capacity, *like.shape[1:])
            if buf is not None:
                new[:, :old] = buf
            return new

        self.k, self.v = grown(self.k, k), grown(self.v, v)
        self.lam = grown(self.lam, lam) if lam is not None else None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_f: torch.Tensor | None,
               bounds: list[int], backend=None, scale: float | None = None) -> torch.Tensor:
        """Append the new rows k, v (and the gates) of each document (packed, host boundaries
        `bounds`, one document of the cache each) and attend the new queries over everything
        cached. Prompts into an empty cache go through the model's attention backend `backend`
        with the documents' boundaries. `scale`: the logit scale when queries and keys are wider
        than the values (SeqPE), else 1 / sqrt(head_dim)."""
        starts = list(self.lengths)
        spans = list(zip(bounds[:-1], bounds[1:], strict=True))
        if len(spans) != len(starts):
            raise ValueError(f"{len(spans)} documents of new tokens for a cache of {len(starts)}")
        lam_new = None
        if log_f is not None:  # each document's cumulative gate goes on from its last cached key's
            lam_new = torch.cat([log_f[a:b].float().cumsum(0) + (self.lam[i, s - 1] if s else 0.0)
                                 for i, ((a, b), s) in enumerate(zip(spans, starts, strict=True))])
        self._grow(max(s + b - a for (a, b), s in zip(spans, starts, strict=True)), k, v, lam_new)
        single = all(b - a == 1 for a, b in spans)
        if single:  # one token a document (a decode step): one write for all
            rows = torch.arange(len(starts), device=k.device)
            at = torch.tensor(starts, device=k.device)
            self.k[rows, at], self.v[rows, at] = k, v
            if lam_new is not None:
                self.lam[rows, at] = lam_new
        else:
            for i, ((a, b), s) in enumerate(zip(spans, starts, strict=True)):
                self.k[i, s:s + b - a], self.v[i, s:s + b - a] = k[a:b], v[a:b]
                if lam_new is not None:
                    self.lam[i, s:s + b - a] = lam_new[a:b]
        self.lengths = [s + b - a for (a, b), s in zip(spans, starts, strict=True)]
        if backend is not None and not any(starts) and not single:
            cu = torch.tensor(bounds, dtype=torch.int32, device=q.device)
            return backend(q, k, v, cu, log_f, scale)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        if single:
            return self._step(q, lam_new, scale)
        out = []  # several new tokens after a cached part: a document at a time, causal among them
        for i, ((a, b), s) in enumerate(zip(spans, starts, strict=True)):
            end = s + b - a
            lam = None if lam_new is None else lam_new[None, a:b]
            out.append(attend_cached(q[None, a:b], self.k[i:i + 1, :end], self.v[i:i + 1, :end], lam,
                                     None if lam is None else self.lam[i:i + 1, :end],
                                     torch.arange(s, end, device=q.device)[None], scale)[0])
        return torch.cat(out)

    def _step(self, q: torch.Tensor, lam_new: torch.Tensor | None, scale: float) -> torch.Tensor:
        """One new query a document, q [B, H, D], over the documents' cached rows."""
        top = max(self.lengths)
        keys, values = self.k[:, :top], self.v[:, :top]
        lam = None if lam_new is None else self.lam[:, :top]
        if q.is_cuda and KERNEL and scale == q.shape[-1] ** -0.5:
            from .fox.decode import decode_attention

            return decode_attention(q, keys, values, lam_new, lam, lengths=torch.tensor(self.lengths, device=q.device))
        q_pos = torch.tensor(self.lengths, device=q.device)[:, None] - 1
        return attend_cached(q[:, None], keys, values, None if lam is None else lam_new[:, None], lam, q_pos,
                             scale)[:, 0]

    def keep(self, rows: list[int]) -> None:
        """Only the documents at these indices, in this order (finished ones leave the batch)."""
        for name in ("k", "v", "lam", "k_before", "v_before"):
            buf = getattr(self, name)
            if buf is not None:
                setattr(self, name, buf[rows])
        self.lengths = [self.lengths[i] for i in rows]


class Cache(list):
    """One LayerCache per layer for B documents, and the number of tokens each holds."""

    def __init__(self, n_layers: int, docs: int = 1, reserve: int = 0):
        super().__init__(LayerCache(docs, reserve) for _ in range(n_layers))
        self.lengths = [0] * docs
        self.frequencies: list[torch.Tensor | None] = [None] * docs

    def bounds(self, n: int, cu_seqlens: torch.Tensor | list[int] | None) -> list[int]:
        """The host boundaries of n new tokens over the cache's documents: as given, or the whole
        of them for one document, or one token each for as many documents."""
        docs = len(self.lengths)
        if cu_seqlens is not None:
            bounds = [int(b) for b in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]
        elif docs == 1:
            bounds = [0, n]
        elif n == docs:
            bounds = list(range(n + 1))
        else:
            raise ValueError(f"{n} new tokens over a cache of {docs} documents: give their cu_seqlens")
        if len(bounds) != docs + 1 or bounds[0] != 0 or bounds[-1] != n:
            raise ValueError(f"cu_seqlens {bounds} do not split {n} new tokens over the cache's {docs} documents")
        return bounds

    def keep(self, rows: list[int]) -> None:
        for layer in self:
            layer.keep(rows)
        self.lengths = [self.lengths[i] for i in rows]
        self.frequencies = [self.frequencies[i] for i in rows]


def _frequencies(model: Transformer, length: int) -> torch.Tensor | None:
    rope = model.cfg.rope
    if rope is None or not depends_on_length(rope):
        return None
    return inverse_frequencies(rope, model.cfg.dim_head, model.cfg.max_position_embeddings, length)[0]


def _last_logits(model: Transformer, ids: torch.Tensor, bounds: list[int], cache: Cache) -> torch.Tensor:
    """The next-token logits after each document's new tokens (the head on those rows only: a
    64K-token prompt's full logits would be 64K x vocab)."""
    hidden = model.hidden(ids, bounds, cache=cache)
    return model.lm_head(hidden[torch.tensor(bounds[1:], device=hidden.device) - 1])


@torch.no_grad()
def generate_batch(model: Transformer, prompts: list[torch.Tensor], max_new_tokens: int | list[int],
                   eos_id: int | None = None) -> list[torch.Tensor]:
    """Greedy continuations of several prompts [T_b] at once; returns each prompt + its new
    tokens (up to its max_new_tokens, or through eos_id). The same tokens as one prompt at a
    time, up to float rounding: a document never sees another."""
    if isinstance(max_new_tokens, int):
        max_new_tokens = [max_new_tokens] * len(prompts)
    tokens = [p.reshape(-1).clone() for p in prompts]
    active = [i for i, n in enumerate(max_new_tokens) if n > 0]
    cache: Cache | None = None
    new_ids: torch.Tensor | None = None
    while active:
        freqs = [_frequencies(model, tokens[i].numel()) for i in active]
        stale = cache is not None and any(
            f is not None and not torch.equal(f, c) for f, c in zip(freqs, cache.frequencies, strict=True))
        if cache is None or stale:  # prefill (again, with the new frequencies): every active prompt, packed
            cache = Cache(model.cfg.n_layers, len(active),
                          max(max_new_tokens[i] - tokens[i].numel() + prompts[i].numel() for i in active))
            bounds = [0]
            for i in active:
                bounds.append(bounds[-1] + tokens[i].numel())
            logits = _last_logits(model, torch.cat([tokens[i] for i in active]), bounds, cache)
        else:
            logits = _last_logits(model, new_ids, list(range(len(active) + 1)), cache)
        cache.frequencies = freqs
        nxt = logits.argmax(-1)
        going = []
        for row, (i, t) in enumerate(zip(active, nxt.tolist(), strict=True)):
            tokens[i] = torch.cat((tokens[i], nxt[row:row + 1]))
            if tokens[i].numel() - prompts[i].numel() < max_new_tokens[i] and t != eos_id:
                going.append(row)
        if len(going) < len(active):
            cache.keep(going)
        active = [active[r] for r in going]
        new_ids = nxt[going]
    return tokens


def generate(model: Transformer, prompt: torch.Tensor, max_new_tokens: int, eos_id: int | None = None) -> torch.Tensor:
    """Greedy continuation of one prompt [T]; returns prompt + new tokens."""
    return generate_batch(model, [prompt], max_new_tokens, eos_id)[0]
