"""Needle-driven perplexity (LongRoPE2): a magic-number sentence near the start of a long real
document, the question at the end, and the loss on the answer tokens only. Plain perplexity
over all tokens rewards local fluency and picks worse RoPE factors; the needle's answer can only
be predicted by attending across the whole window.

The builder is shared by `rope_search` (fitness and the method table) and the eval stage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..data.loader import PackedDataset
from ..data.tokenizer import TextTokenizer
from ..errors import DataError
from ..model.loss import IGNORE
from ..model.transformer import Transformer

KEYS = ["apple", "river", "copper", "violet", "harbor", "lantern", "meadow", "falcon", "granite", "orchid",
        "saffron", "tundra", "walnut", "ember", "glacier", "marble", "thistle", "cobalt", "juniper", "quartz"]


@dataclass(frozen=True)
class NeedleSequence:
    ids: np.ndarray
    """length tokens: haystack with the needle near the start, the question and the answer last."""
    answer: np.ndarray
    """Positions of the answer tokens (the only ones scored)."""
    key: str
    value: str


def long_documents(data: PackedDataset, length: int) -> list[int]:
    """Indices of sequences that open with one real long document (a `long` domain's, not a
    synthetic retrieval document or short text; any domain's in data packed before kinds were
    recorded) of at least `length` tokens."""
    real = {i for i, d in enumerate(data.domains) if data.kinds.get(d, "long") == "long"}
    return [i for i in range(len(data)) if int(data[i].doc_lens[0]) >= length and int(data[i].domains[0]) in real]


def build(tokenizer: TextTokenizer, haystack: np.ndarray, length: int, depth: float,
          rng: np.random.Generator) -> NeedleSequence:
    """One needle sequence of exactly `length` tokens cut from a real document (`haystack`)."""
    key = KEYS[int(rng.integers(len(KEYS)))]
    value = str(int(rng.integers(1_000_000, 10_000_000)))
    needle, question, answer = tokenizer.encode_texts(
        [f" One of the special magic numbers for {key} is: {value}. ",
         f" What is the special magic number for {key}? The special magic number for {key} is:",
         f" {value}."], add_bos=False, add_eos=False)
    fill = length - len(needle) - len(question) - len(answer)
    if fill < 16 or len(haystack) < fill:
        raise DataError(f"needle sequences of {length} tokens need a document of {max(fill, 16)} tokens")
    at = max(1, int(depth * fill))
    ids = np.concatenate([haystack[:at], needle, haystack[at:fill], question, answer]).astype(np.int64)
    return NeedleSequence(ids, np.arange(length - len(answer), length), key, value)


def sequences(data: PackedDataset, tokenizer: TextTokenizer, length: int, count: int, depth: float,
              seed: int) -> list[NeedleSequence]:
    """`count` needle sequences at `length`, each from a different long document (seeded)."""
    docs = long_documents(data, length)
    if len(docs) < count:
        raise DataError(f"{data.folder}: {len(docs)} documents of >= {length} tokens, {count} needed for needle "
                        f"sequences (lower the count or the length, or add long data)")
    rng = np.random.default_rng(seed)
    chosen = sorted(rng.choice(docs, size=count, replace=False).tolist())
    return [build(tokenizer, np.asarray(data[i].input_ids[:length]), length, depth, rng) for i in chosen]


def labels_of(seq: NeedleSequence) -> torch.Tensor:
    """Next-token labels scoring only the answer: label at position p is the token at p + 1."""
    labels = torch.full((len(seq.ids),), IGNORE, dtype=torch.int64)
    labels[seq.answer - 1] = torch.from_numpy(seq.ids[seq.answer])
    return labels


def plain_labels(ids: np.ndarray) -> torch.Tensor:
    labels = torch.full((len(ids),), IGNORE, dtype=torch.int64)
    labels[:-1] = torch.from_numpy(np.asarray(ids[1:], dtype=np.int64))
    return labels


@torch.no_grad()
def mean_nll(model, batch: list[tuple[np.ndarray, torch.Tensor]], batch_tokens: int = 32768) -> float:
    """Mean next-token loss over the labelled tokens of (ids, labels) documents, packed into
    forwards of about `batch_tokens` tokens (documents never attend to each other)."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for group in groups([len(ids) for ids, _ in batch], batch_tokens):
        ids = torch.cat([torch.from_numpy(np.asarray(batch[i][0], dtype=np.int64)) for i in group]).to(device)
        labels = torch.cat([batch[i][1] for i in group]).to(device)
        cu = torch.tensor([0, *np.cumsum([len(batch[i][0]) for i in group])], dtype=torch.int32, device=device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
            total += float(model(ids, cu, labels=labels))
        count += int((labels != IGNORE).sum())
    return total / max(count, 1)


def needle_nll(model, seqs: list[NeedleSequence], batch_tokens: int = 32768) -> float:
    return mean_nll(model, [(s.ids, labels_of(s)) for s in seqs], batch_tokens)


def needle_nlls(model, seqs: list[NeedleSequence]) -> tuple[np.ndarray, np.ndarray]:
    """Per sequence: the answer's summed next-token loss and its token count (one forward each),
    for intervals over sequences."""
    sums, counts = [], []
    for s in seqs:
        labels = labels_of(s)
        counts.append(int((labels != IGNORE).sum()))
        sums.append(mean_nll(model, [(s.ids, labels)], len(s.ids)) * counts[-1])
    return np.asarray(sums), np.asarray(counts)


def ppl_interval(sums: np.ndarray, counts: np.ndarray, draws: int = 2000, level: float = 0.95,
                 seed: int = 0) -> tuple[float, float]:
    """Bootstrap interval of the perplexity over sequences (resampled with replacement): how much
    a verdict on a handful of needles can be trusted."""
    rng = np.random.default_rng(seed)
    pick = rng.integers(len(sums), size=(draws, len(sums)))
    ppl = np.exp(np.minimum(sums[pick].sum(1) / np.maximum(counts[pick].sum(1), 1), 700.0))
    lo, hi = np.quantile(ppl, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def plain_nll(model, docs: list[np.ndarray], batch_tokens: int = 32768) -> float:
    return mean_nll(model, [(d, plain_labels(d)) for d in docs], batch_tokens)


@torch.no_grad()
def position_loss(model: Transformer, docs: list[np.ndarray]) -> np.ndarray:
    """Mean next-token loss at every position (FoX paper Figure 2), over single documents."""
    device = next(model.parameters()).device
    n = min(len(d) for d in docs)
    total = torch.zeros(n - 1, dtype=torch.float64)
    for d in docs:
        ids = torch.from_numpy(np.asarray(d[:n], dtype=np.int64)).to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(ids).float()
        loss = torch.nn.functional.cross_entropy(logits[:-1], ids[1:], reduction="none")
        total += loss.double().cpu()
    return (total / len(docs)).numpy()


def perplexity(nll: float) -> float:
    return math.exp(min(nll, 700.0))


def groups(lengths: list[int], budget: int) -> list[list[int]]:
    """Consecutive indices in runs of at most `budget` tokens (a longer item alone)."""
    out, cur, used = [], [], 0
    for i, n in enumerate(lengths):
        if cur and used + n > budget:
            out.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        out.append(cur)
    return out
