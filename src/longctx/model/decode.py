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
LONGCTX_DRAFT_TOKENS=0): one token a step. FoX too: a refused guess's gates are overwritten by
the next rows, and KV-shift's state goes back to the last kept row's projections (`Cache.trim`)."""
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


class Step:
    """Where one forward's new tokens go in a cache, worked out once for all its layers: for each
    token its document, its row there (its position) and its place among its document's new
    tokens, for each document the index of its last new token and its length after, on the
    host and, in one pinned copy (no sync), on the device. `bounds`: the new tokens' host
    boundaries, one document of the cache each; `starts`: the rows each document held before."""

    def __init__(self, bounds: list[int], starts: list[int], device: torch.device):
        if len(bounds) != len(starts) + 1:
            raise ValueError(f"{len(bounds) - 1} documents of new tokens for a cache of {len(starts)}")
        self.bounds, self.starts = bounds, list(starts)
        sizes = np.diff(bounds)
        self.ends = [s + int(z) for s, z in zip(starts, sizes, strict=True)]
        self.single = bool((sizes == 1).all())  # one token a document: a decode step without guesses
        self.width = int(sizes.max(initial=0))  # the most new tokens of one document
        doc = np.repeat(np.arange(len(starts)), sizes)
        offset = np.arange(bounds[-1]) - np.repeat(bounds[:-1], sizes)
        lasts = np.maximum(np.asarray(bounds[1:]) - 1, 0)  # (a document without new tokens: a row of no meaning)
        n, b = bounds[-1], len(starts)
        parts = (doc, np.asarray(starts, dtype=np.int64)[doc] + offset, offset, np.arange(b), starts, self.ends, lasts,
                 bounds)
        buf = to_device(torch.from_numpy(np.concatenate(parts).astype(np.int64)), device)
        self.doc, self.row, self.offset, self.docs, self.starts_dev, self.ends_dev, self.lasts, cu = buf.split(
            [n, n, n, b, b, b, b, b + 1])
        self.cu = cu.int()


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
        self._projections: tuple[torch.Tensor, torch.Tensor] | None = None  # the last forward's W x (KV-shift)

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

    def shift(self, k: torch.Tensor, v: torch.Tensor, step: Step) -> None:
        """KV-shift's state after a forward: the projections W x of its new tokens k, v, each
        document's last one carried into the next forward (`trim` picks an earlier one)."""
        self._projections = k, v
        self.k_before, self.v_before = k[step.lasts], v[step.lasts]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_f: torch.Tensor | None,
               at: Step | list[int], backend=None, scale: float | None = None, last: bool = False) -> torch.Tensor:
        """Append the new rows k, v (and the gates) of each document (packed, placed by `at`:
        the forward's Step, or their host boundaries, one document of the cache each) and attend
        the new queries over everything cached. Prompts into an empty cache go through the
        model's attention backend `backend` with the documents' boundaries. `scale`: the logit
        scale when queries and keys are wider than the values (SeqPE), else 1 / sqrt(head_dim).
        `last`: only each document's last new query attends, one a document as in a decode step
        ([docs, H, D]; a document without new tokens gets a row of no meaning)."""
        step = at if isinstance(at, Step) else Step(at, self.lengths, k.device)
        if step.starts != self.lengths:
            raise ValueError(f"a step placed after {step.starts} rows over a cache holding {self.lengths}")
        lam_new = None if log_f is None else self._gates(log_f.float(), step)
        self._grow(max(step.ends), k, v, lam_new)
        self.k[step.doc, step.row], self.v[step.doc, step.row] = k, v  # (one write each, whatever the documents)
        if lam_new is not None:
            self.lam[step.doc, step.row] = lam_new
        self.lengths = list(step.ends)
        if backend is not None and not any(step.starts) and not step.single and not last:
            return backend(q, k, v, step.cu, log_f, scale)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        if step.single:
            return self._step(q, lam_new, scale, step.ends_dev)
        if last:
            return self._step(q[step.lasts], None if lam_new is None else lam_new[step.lasts], scale, step.ends_dev)
        return self._queries(q, lam_new, step, scale)

    def _gates(self, log_f: torch.Tensor, step: Step) -> torch.Tensor:
        """Each new token's cumulative log forget gate [N, H], going on from its document's last
        cached key's: a decode step adds one gate to it, several new tokens a document add their
        running sums, laid out [docs, most new tokens, H] (a few ops, not a few a document)."""
        if step.single and self.lam is not None:
            return log_f + self.lam[step.doc, (step.row - 1).clamp(min=0)] * (step.row > 0)[:, None]
        padded = log_f.new_zeros(len(step.starts), step.width, log_f.shape[-1])
        padded[step.doc, step.offset] = log_f
        sums = padded.cumsum(1)
        if self.lam is not None:
            starts = step.starts_dev
            sums = sums + (self.lam[step.docs, (starts - 1).clamp(min=0)] * (starts > 0)[:, None])[:, None]
        return sums[step.doc, step.offset]

    def _queries(self, q: torch.Tensor, lam_new: torch.Tensor | None, step: Step, scale: float) -> torch.Tensor:
        """Several new queries a document after its cached rows (a step's guesses, a forked
        prompt's rest), each over its document's keys up to its own row: one FlashAttention-2
        call for plain attention on CUDA, the decode kernel a query for FoX's gates, else the
        float softmax over the documents' new queries side by side."""
        if q.is_cuda and lam_new is None and q.dtype in (torch.float16, torch.bfloat16) \
                and not head_dim_refused("varlen", q.shape[-1]):
            return self._continued(q, step, scale)
        top = max(self.lengths)
        keys, values, lam = self.k[:, :top], self.v[:, :top], None if lam_new is None else self.lam[:, :top]
        if q.is_cuda and KERNEL and scale == q.shape[-1] ** -0.5:
            from .fox.decode import decode_attention

            return decode_attention(q, keys, values, lam_new, lam, lengths=step.row + 1, docs=step.doc)
        padded = q.new_zeros(len(step.starts), step.width, *q.shape[1:])
        padded[step.doc, step.offset] = q
        lam_q = None
        if lam_new is not None:
            lam_q = lam_new.new_zeros(*padded.shape[:2], lam_new.shape[-1])
            lam_q[step.doc, step.offset] = lam_new
        q_pos = step.starts_dev[:, None] + torch.arange(step.width, device=q.device)
        return attend_cached(padded, keys, values, lam_q, lam, q_pos, scale)[step.doc, step.offset]

    def _continued(self, q: torch.Tensor, step: Step, scale: float) -> torch.Tensor:
        """New queries of several documents (some may have none) over each one's cached keys, its
        new ones last, in one FlashAttention-2 call over the buffer as it lies: document b's keys
        are the first lengths[b] rows of its row of the buffer, and the causal mask aligns its last
        query with its last key. (No copy of the cache: a decode step's guesses read it once.)"""
        docs, capacity = self.k.shape[:2]
        cu_k = torch.arange(0, (docs + 1) * capacity, capacity, dtype=torch.int32, device=q.device)
        keys, values = (buf.view(docs * capacity, *buf.shape[2:]) for buf in (self.k, self.v))
        return flash_forward(q.contiguous(), keys, values, step.cu, cu_k, step.width, max(self.lengths), scale,
                             step.ends_dev.int())[0]

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

    def _step(self, q: torch.Tensor, lam_new: torch.Tensor | None, scale: float,
              lengths: torch.Tensor) -> torch.Tensor:
        """One new query a document, q [B, H, D], over the documents' cached rows (`lengths`, on
        the device: how many each holds)."""
        top = max(self.lengths)
        keys, values = self.k[:, :top], self.v[:, :top]
        lam = None if lam_new is None else self.lam[:, :top]
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
        self._projections = None

    def trim(self, lengths: list[int], lasts: torch.Tensor | None = None) -> None:
        """Forget each document's rows past lengths[b] (guessed tokens the model did not agree
        with): they are masked by the lengths and overwritten by the next rows; the gates of the
        rows kept are their own. KV-shift's state goes back to the projections of each
        document's last row kept, at `lasts` among the last forward's new tokens."""
        if self.k_before is not None:
            if lasts is None or self._projections is None:
                raise ValueError("a KV-shift cache drops rows of its last forward only, given their last rows kept")
            self.k_before, self.v_before = (p[lasts] for p in self._projections)
        self.lengths = list(lengths)


class Cache(list):
    """One LayerCache per layer for B documents, and the number of tokens each holds."""

    def __init__(self, n_layers: int, docs: int = 1, reserve: int = 0):
        super().__init__(LayerCache(docs, reserve) for _ in range(n_layers))
        self.lengths = [0] * docs
        self.frequencies: list[torch.Tensor | None] = [None] * docs
        self.step: Step | None = None  # where the current forward's new tokens go, for every layer

    def begin(self, n: int, cu_seqlens: torch.Tensor | list[int] | None, device: torch.device) -> Step:
        """A forward of n new tokens (`bounds`' split): its Step, which its layers share."""
        self.step = Step(self.bounds(n, cu_seqlens), self.lengths, device)
        return self.step

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
        self.step = None  # (its places are of the documents before)
        for layer in self:
            layer.keep(rows)
        self.lengths = [self.lengths[i] for i in rows]
        self.frequencies = [self.frequencies[i] for i in rows]

    def trim(self, lengths: list[int]) -> None:
        """Each document back to lengths[b] rows, keeping at least one of the last forward's new
        tokens (a decode step's own token before its guesses)."""
        step = self.step
        if step is None or not all(s < n <= e for s, n, e in zip(step.starts, lengths, step.ends, strict=True)):
            raise ValueError(f"trim to {lengths}: each document keeps some of its last forward's new rows "
                             f"(after {None if step is None else step.starts}, up to {step and step.ends})")
        lasts = [a + n - s - 1 for a, n, s in zip(step.bounds[:-1], lengths, step.starts, strict=True)]
        lasts = to_device(torch.tensor(lasts), step.doc.device) if self[0].k_before is not None else None
        for layer in self:
            layer.trim(lengths, lasts)
        self.lengths = list(lengths)

    def fork(self, sources: list[int], shared: list[int], rows: int) -> None:
        """Append documents that begin as cached ones (LayerCache.fork), in every layer."""
        self.step = None
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
    draft = DRAFT_TOKENS if draft is None else draft
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
