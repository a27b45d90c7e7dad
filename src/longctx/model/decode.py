"""Incremental greedy decoding with a KV cache, for every position encoding and FoX, several
documents at once.

A cache holds B documents side by side: per layer the (rotated) keys and values in rows
[b, 0, length_b), and for FoX the running cumulative log forget gate of every cached key and the
KV-shift's last projections. The prompts are prefilled packed, through the model's attention
backend (the training path: documents masked from each other, no prompt x prompt score matrix);
then every unfinished document takes one token a step, so a step costs one forward for all of
them. When the rotary frequencies change with the length (LongRoPE crossing its original
window, dynamic NTK beyond it) the cached keys are stale, so the cache is rebuilt from the tokens.

Prompts that begin alike (one haystack, each needle at its own depth) are prefilled once where
they agree: the prompt that shares the most with the others is computed whole, and each of the
others starts as a copy of its cache up to their common prefix and prefills only the rest.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from .config import head_dim_refused
from .cudnn_attention import flash_forward
from .rope import depends_on_length, inverse_frequencies
from .transfer import to_device
from .transformer import Transformer

KERNEL = os.environ.get("LONGCTX_DECODE", "kernel") != "math"
"""On CUDA one new token attends through the Triton decode kernel (fox/decode.py);
LONGCTX_DECODE=math keeps the plain PyTorch path there too (bench/decode.py times both)."""

SHARED_PREFIX = os.environ.get("LONGCTX_SHARED_PREFIX", "on") != "off"
"""Prompts prefill their common prefixes once (`share_plan`); LONGCTX_SHARED_PREFIX=off prefills
every prompt whole (bench/eval_throughput.py --shared-prefix times both)."""
DRAFT_TOKENS = int(os.environ.get("LONGCTX_DRAFT_TOKENS", "8"))
"""Greedy decoding guesses up to this many tokens a document a step (`lookup_draft`) and keeps
those the model agrees with, so a step of the batch may add several tokens to each; 0 (env
LONGCTX_DRAFT_TOKENS=0): one token a step. Plain attention only (a FoX cache carries state past
each row that a refused guess would leave behind)."""
SHARE_MIN_TOKENS = 4096
SHARE_MIN_FRACTION = 0.5
"""A prompt takes its prefix from another when they agree on at least this many tokens and this
share of its own length. A forked prompt's rest attends over all its keys through
FlashAttention-2, 1.46x slower than cuDNN at 64K: by the FLOPs of attention (72% of the 64K
prefill) and of the per-token layers, a prompt sharing under ~45% of itself would cost more than
prefilled whole. At 4K prompts (FlashAttention-2 either way) forking measured 0.95x, at 16K-64K
1.07-1.09x (bench/results/eval-throughput/eval-throughput-nvidia-h200-2026-12-03)."""


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
               bounds: list[int], backend=None, scale: float | None = None, last: bool = False) -> torch.Tensor:
        """Append the new rows k, v (and the gates) of each document (packed, host boundaries
        `bounds`, one document of the cache each) and attend the new queries over everything
        cached. Prompts into an empty cache go through the model's attention backend `backend`
        with the documents' boundaries. `scale`: the logit scale when queries and keys are wider
        than the values (SeqPE), else 1 / sqrt(head_dim). `last`: only each document's last new
        query attends, one a document as in a decode step ([docs, H, D]; a document without new
        tokens gets a row of no meaning)."""
        starts = list(self.lengths)
        spans = list(zip(bounds[:-1], bounds[1:], strict=True))
        if len(spans) != len(starts):
            raise ValueError(f"{len(spans)} documents of new tokens for a cache of {len(starts)}")
        single = all(b - a == 1 for a, b in spans)
        if single:  # one token a document (a decode step): its rows, for one read and one write for all
            rows = torch.arange(len(starts), device=k.device)
            at = to_device(torch.tensor(starts), k.device)  # (pinned: a pageable copy would sync every layer)
        lam_new = None  # each document's cumulative gate goes on from its last cached key's
        if log_f is not None and single and self.lam is not None:  # (a few ops, not a few a document)
            lam_new = log_f.float() + self.lam[rows, (at - 1).clamp(min=0)] * (at > 0)[:, None]
        elif log_f is not None:
            lam_new = torch.cat([log_f[a:b].float().cumsum(0) + (self.lam[i, s - 1] if s else 0.0)
                                 for i, ((a, b), s) in enumerate(zip(spans, starts, strict=True))])
        self._grow(max(s + b - a for (a, b), s in zip(spans, starts, strict=True)), k, v, lam_new)
        if single:
            self.k[rows, at], self.v[rows, at] = k, v
            if lam_new is not None:
                self.lam[rows, at] = lam_new
        else:
            for i, ((a, b), s) in enumerate(zip(spans, starts, strict=True)):
                self.k[i, s:s + b - a], self.v[i, s:s + b - a] = k[a:b], v[a:b]
                if lam_new is not None:
                    self.lam[i, s:s + b - a] = lam_new[a:b]
        self.lengths = [s + b - a for (a, b), s in zip(spans, starts, strict=True)]
        if backend is not None and not any(starts) and not single and not last:
            cu = torch.tensor(bounds, dtype=torch.int32, device=q.device)
            return backend(q, k, v, cu, log_f, scale)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        if last and not single:
            ends = torch.tensor([max(b - 1, 0) for _, b in spans], device=q.device)
            return self._step(q[ends], None if lam_new is None else lam_new[ends], scale)
        if single:
            return self._step(q, lam_new, scale)
        if q.is_cuda and lam_new is None and q.dtype in (torch.float16, torch.bfloat16) \
                and not head_dim_refused("varlen", q.shape[-1]):
            return self._continued(q, spans, scale)
        out = []  # several new tokens after a cached part: a document at a time, causal among them
        for i, ((a, b), s) in enumerate(zip(spans, starts, strict=True)):
            if a == b:
                continue
            end = s + b - a
            lam = None if lam_new is None else lam_new[None, a:b]
            out.append(attend_cached(q[None, a:b], self.k[i:i + 1, :end], self.v[i:i + 1, :end], lam,
                                     None if lam is None else self.lam[i:i + 1, :end],
                                     torch.arange(s, end, device=q.device)[None], scale)[0])
        return torch.cat(out)

    def _continued(self, q: torch.Tensor, spans: list[tuple[int, int]], scale: float) -> torch.Tensor:
        """New queries of several documents (some may have none) over each one's cached keys, its
        new ones last, in one FlashAttention-2 call over the buffer as it lies: document b's keys
        are the first lengths[b] rows of its row of the buffer, and the causal mask aligns its last
        query with its last key. (No copy of the cache: a decode step's guesses read it once.)"""
        docs, capacity = self.k.shape[:2]
        cu_q = torch.tensor([0] + [b for _, b in spans], dtype=torch.int32, device=q.device)
        cu_k = torch.arange(0, (docs + 1) * capacity, capacity, dtype=torch.int32, device=q.device)
        used = torch.tensor(self.lengths, dtype=torch.int32, device=q.device)
        keys, values = (buf.view(docs * capacity, *buf.shape[2:]) for buf in (self.k, self.v))
        return flash_forward(q.contiguous(), keys, values, cu_q, cu_k, max(b - a for a, b in spans),
                             max(self.lengths), scale, used)[0]

    def fork(self, sources: list[int], shared: list[int], rows: int) -> None:
        """Append documents that begin as cached ones: the j-th holds the first shared[j] rows of
        document sources[j]; room for `rows` rows each (and the reserve). Plain attention only
        (FoX's gates and KV-shift carry state past each row)."""
        if self.lam is not None or self.k_before is not None:
            raise ValueError("a FoX cache cannot fork: its gates and KV-shift carry state past each row")
        old, capacity = len(self.lengths), max(self.k.shape[1], rows + self.reserve)
        device = self.k.device
        index = torch.tensor(sources, device=device)
        kept = torch.arange(self.k.shape[1], device=device)[None] < torch.tensor(shared, device=device)[:, None]

        def forked(buf: torch.Tensor) -> torch.Tensor:
            new = buf.new_zeros(old + len(sources), capacity, *buf.shape[2:])
            new[:old, :buf.shape[1]] = buf
            new[old:, :buf.shape[1]] = torch.where(kept[:, :, None, None], buf[index], 0)
            return new

        self.k, self.v = forked(self.k), forked(self.v)
        self.lengths = self.lengths + list(shared)

    def _step(self, q: torch.Tensor, lam_new: torch.Tensor | None, scale: float) -> torch.Tensor:
        """One new query a document, q [B, H, D], over the documents' cached rows."""
        top = max(self.lengths)
        keys, values = self.k[:, :top], self.v[:, :top]
        lam = None if lam_new is None else self.lam[:, :top]
        lengths = to_device(torch.tensor(self.lengths), q.device)
        if q.is_cuda and KERNEL and scale == q.shape[-1] ** -0.5:
            from .fox.decode import decode_attention

            return decode_attention(q, keys, values, lam_new, lam, lengths=lengths)
        q_pos = lengths[:, None] - 1
        return attend_cached(q[:, None], keys, values, None if lam is None else lam_new[:, None], lam, q_pos,
                             scale)[:, 0]

    def keep(self, rows: list[int]) -> None:
        """Only the documents at these indices, in this order (finished ones leave the batch)."""
        for name in ("k", "v", "lam", "k_before", "v_before"):
            buf = getattr(self, name)
            if buf is not None:
                setattr(self, name, buf[rows])
        self.lengths = [self.lengths[i] for i in rows]

    def trim(self, lengths: list[int]) -> None:
        """Forget each document's rows past lengths[b] (guessed tokens the model did not agree
        with): they are masked by the lengths and overwritten by the next rows. Plain attention
        only (FoX's KV-shift keeps the last row's projections)."""
        if self.k_before is not None:
            raise ValueError("a KV-shift cache cannot drop rows: it keeps the last row's projections")
        self.lengths = list(lengths)


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

    def trim(self, lengths: list[int]) -> None:
        for layer in self:
            layer.trim(lengths)
        self.lengths = list(lengths)

    def fork(self, sources: list[int], shared: list[int], rows: int) -> None:
        """Append documents that begin as cached ones (LayerCache.fork), in every layer."""
        for layer in self:
            layer.fork(sources, shared, rows)
        self.lengths = self.lengths + list(shared)
        self.frequencies = self.frequencies + [self.frequencies[i] for i in sources]


def common_prefixes(prompts: list[torch.Tensor]) -> np.ndarray:
    """[B, B] on the host: how many tokens each pair of prompts [T_b] begins with alike."""
    lengths = torch.tensor([p.numel() for p in prompts])
    grid = torch.full((len(prompts), int(lengths.max())), -1, dtype=torch.int64, device=prompts[0].device)
    for i, p in enumerate(prompts):
        grid[i, :p.numel()] = p
    agree = []
    for i in range(len(prompts)):
        differ = grid != grid[i]
        agree.append(torch.where(differ.any(1), differ.int().argmax(1), grid.shape[1]))
    shortest = torch.minimum(lengths[:, None], lengths[None, :])
    return torch.minimum(torch.stack(agree).cpu(), shortest).numpy()


def share_plan(agree: np.ndarray, lengths: list[int], allowed: np.ndarray | None, min_tokens: int,
               min_fraction: float) -> list[tuple[int, int]]:
    """(source, shared tokens) for each prompt, source -1 for one prefilled whole. `agree`: the
    common prefixes (`common_prefixes`); `allowed[i, j]`: whether j may take i's keys at all
    (the same rotary frequencies); a prompt shares only `min_tokens` and `min_fraction` of its
    length or more. Greedily, the prompt whose prefix the remaining others would
    share the most tokens of is computed whole and those others fork from it; a forked prompt
    keeps at least one token of its own (its last, whose logits it needs)."""
    n = len(lengths)
    size = np.asarray(lengths)
    worth = np.minimum(agree, size[None, :] - 1)
    worth = np.where((worth >= min_tokens) & (worth >= min_fraction * size[None, :]), worth, 0)
    np.fill_diagonal(worth, 0)
    if allowed is not None:
        worth = np.where(allowed, worth, 0)
    plan, free = [(-1, 0)] * n, np.ones(n, dtype=bool)
    while free.any():
        gain = np.where(free, (worth * free[None, :]).sum(1), -1)
        source = int(gain.argmax())
        if gain[source] <= 0:
            break
        free[source] = False
        for j in np.flatnonzero(free & (worth[source] > 0)):
            plan[j], free[j] = (source, int(worth[source, j])), False
    return plan


def _frequencies(model: Transformer, length: int) -> torch.Tensor | None:
    rope = model.cfg.rope
    if rope is None or not depends_on_length(rope):
        return None
    return inverse_frequencies(rope, model.cfg.dim_head, model.cfg.max_position_embeddings, length)[0]


def _last_logits(model: Transformer, ids: torch.Tensor, bounds: list[int], cache: Cache) -> torch.Tensor:
    """The next-token logits after each document's new tokens (the final block and the head on
    those rows only: a 64K-token prompt's full logits would be 64K x vocab)."""
    return model.lm_head(model.hidden(ids, bounds, cache=cache, last=True))


def _shareable(model: Transformer) -> bool:
    """Whether a document's cached rows depend on nothing after them (plain attention: not
    FoX's gates nor ALiBi's decay, carried as gates)."""
    return model.cfg.fox is None and not model.cfg.alibi


def _prefill(model: Transformer, prompts: list[torch.Tensor], reserve: int, share: bool,
             freqs: list[torch.Tensor | None]) -> tuple[Cache, torch.Tensor, list[int]]:
    """(cache, next-token logits, order): the prompts' indices in the order of the cache's
    documents (those prefilled whole first, then those forked from them). `freqs`: each prompt's
    rotary frequencies (`_frequencies`). No prompt longer than SHARE_MIN_TOKENS: no comparison."""
    plan = [(-1, 0)] * len(prompts)
    lengths = [p.numel() for p in prompts]
    if share and len(prompts) > 1 and max(lengths) > SHARE_MIN_TOKENS and _shareable(model):
        allowed = np.array([[f is None and g is None or f is not None and g is not None and torch.equal(f, g)
                             for g in freqs] for f in freqs])
        plan = share_plan(common_prefixes(prompts), lengths, allowed, SHARE_MIN_TOKENS, SHARE_MIN_FRACTION)
    whole = [i for i, (source, _) in enumerate(plan) if source < 0]
    forked = [i for i, (source, _) in enumerate(plan) if source >= 0]
    cache = Cache(model.cfg.n_layers, len(whole), reserve)
    bounds = np.cumsum([0] + [prompts[i].numel() for i in whole]).tolist()
    logits = _last_logits(model, torch.cat([prompts[i] for i in whole]), bounds, cache)
    if forked:
        cache.fork([whole.index(plan[j][0]) for j in forked], [plan[j][1] for j in forked],
                   max(prompts[j].numel() for j in forked))
        rests = [prompts[j][plan[j][1]:] for j in forked]
        bounds = [0] * len(whole) + np.cumsum([0] + [r.numel() for r in rests]).tolist()
        logits = torch.cat((logits, _last_logits(model, torch.cat(rests), bounds, cache)[len(whole):]))
    return cache, logits, whole + forked


def lookup_draft(seq: np.ndarray, k: int, longest: int = 3) -> np.ndarray:
    """Up to k tokens that followed the latest earlier occurrence of seq's last n-gram (the
    longest of `longest` .. 1 tokens that occurs): a guess of what greedy decoding writes next
    (prompt-lookup decoding). In retrieval prompts the answer is a copy of the context, and so is
    the filler a wrong answer goes on with."""
    if k <= 0 or len(seq) < 2:
        return seq[:0]
    ends = best = np.flatnonzero(seq[:-1] == seq[-1])  # where earlier copies of the last token stand
    for back in range(1, min(longest, len(seq) - 1)):  # ... and of the tokens before it
        ends = ends[ends >= back]
        ends = ends[seq[ends - back] == seq[-1 - back]]
        if not ends.size:
            break
        best = ends
    return seq[best[-1] + 1:best[-1] + 1 + k] if best.size else seq[:0]


@torch.no_grad()
def generate_batch(model: Transformer, prompts: list[torch.Tensor], max_new_tokens: int | list[int],
                   eos_id: int | None = None, share: bool | None = None,
                   draft: int | None = None) -> list[torch.Tensor]:
    """Greedy continuations of several prompts [T_b] at once; returns each prompt + its new
    tokens (up to its max_new_tokens, or through eos_id). The same tokens as one prompt at a
    time, up to float rounding: a document never sees another. `share`: common prefixes
    prefilled once (default SHARED_PREFIX). `draft`: up to this many guessed tokens a document a
    step (`lookup_draft`; default DRAFT_TOKENS): the step's forward scores them all, and the
    guesses up to the first the model disagrees with are kept, with its own next token after."""
    share = SHARED_PREFIX if share is None else share
    draft = (DRAFT_TOKENS if draft is None else draft) if _shareable(model) else 0
    budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    device = prompts[0].device
    seqs = [p.reshape(-1).cpu().numpy() for p in prompts]  # the host's copy: each prompt + its new tokens
    new: list[list[int]] = [[] for _ in prompts]
    active = [i for i, n in enumerate(budgets) if n > 0]
    cache: Cache | None = None
    while active:
        freqs = [_frequencies(model, len(seqs[i])) for i in active]
        stale = cache is not None and any(
            f is not None and not torch.equal(f, c) for f, c in zip(freqs, cache.frequencies, strict=True))
        if cache is None or stale:  # prefill (again, with the new frequencies): every active prompt, packed
            reserve = max(budgets[i] - len(new[i]) for i in active)  # (a step's guesses stay in the budget)
            cache, logits, order = _prefill(model, [torch.from_numpy(seqs[i]).to(device) for i in active],
                                            reserve, share, freqs)
            active, freqs = [active[r] for r in order], [freqs[r] for r in order]
            guesses = [seqs[i][:0] for i in active]
        else:  # each document's last token, then its guesses (none where they would cross a frequency change)
            guesses = [lookup_draft(seqs[i], min(draft, budgets[i] - len(new[i]) - 1)) for i in active]
            guesses = [g if f is None or not g.size or torch.equal(f, _frequencies(model, len(seqs[i]) + g.size))
                       else g[:0] for i, g, f in zip(active, guesses, freqs, strict=True)]
            fed = [np.concatenate((seqs[i][-1:], g)) for i, g in zip(active, guesses, strict=True)]
            ids = torch.from_numpy(np.concatenate(fed)).to(device)
            logits = model.lm_head(model.hidden(ids, np.cumsum([0] + [f.size for f in fed]).tolist(), cache=cache))
        cache.frequencies = freqs
        picks, at = logits.argmax(-1).tolist(), 0
        going, kept = [], list(cache.lengths)
        for row, (i, g) in enumerate(zip(active, guesses, strict=True)):
            mine, at = picks[at:at + g.size + 1], at + g.size + 1
            agreed = next((j for j in range(g.size) if mine[j] != g[j]), g.size)
            out = mine[:agreed + 1][:budgets[i] - len(new[i])]
            if eos_id in out:
                out = out[:out.index(eos_id) + 1]
            new[i] += out
            seqs[i] = np.concatenate((seqs[i], np.asarray(out, dtype=seqs[i].dtype)))
            kept[row] -= g.size - agreed  # the rows of guesses after the first one refused
            if len(new[i]) < budgets[i] and out[-1] != eos_id:
                going.append(row)
        if any(k != n for k, n in zip(kept, cache.lengths, strict=True)):
            cache.trim(kept)
        if len(going) < len(active):
            cache.keep(going)
        active = [active[r] for r in going]
    return [torch.cat((p.reshape(-1), torch.tensor(n, dtype=p.dtype, device=p.device)))
            for p, n in zip(prompts, new, strict=True)]


def generate(model: Transformer, prompt: torch.Tensor, max_new_tokens: int, eos_id: int | None = None) -> torch.Tensor:
    """Greedy continuation of one prompt [T]; returns prompt + new tokens."""
    return generate_batch(model, [prompt], max_new_tokens, eos_id)[0]
