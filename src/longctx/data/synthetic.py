"""Synthetic retrieval documents: seeded, procedurally generated texts in the formats the eval
tasks ask about (eval/tasks.py: a pass key, a key-value needle, one needle among distractors,
several needles each asked in turn), each ending with its questions and answers, so a small
model can learn to retrieve inside its window and the tiny profile can show whether that
survives beyond it. ProLong's recipe has no synthetic data; only the tiny profile uses this
source.

Disjoint from evaluation by construction: pass keys have four, six or seven digits (eval's have
five: a model that saw one length only learned to write that many digits, " 355169." for 35516 on
the GPU profile) and needle keys are drawn from words eval never uses (TRAIN_WORDS), so no
training document holds an eval prompt's answer.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

import numpy as np

from ..eval.tasks import NOISE, PASSKEY_ASK, WORDS, niah_ask, niah_needle, passkey_needle

FORMATS = ("passkey", "kv", "multikey", "multiquery")
PASSKEY_DIGITS = (4, 6, 7)
"""Lengths of the pass keys: around eval's five, never five."""
MULTIQUERY_CHARS = 400
"""multiquery: one needle per this many characters (2 to 8), every one asked, in random order:
several answers per document for the same filler (RULER's multi-query, one key per question)."""
TRAIN_WORDS = ["alder", "bramble", "canyon", "dahlia", "elm", "fennel", "glacier", "hazel", "ivy", "jade",
               "kestrel", "larch", "meadow", "nettle", "oak", "poplar", "quince", "reed", "sorrel", "tarn",
               "umbra", "verbena", "wisteria", "yucca", "zinnia", "aspen", "basil", "coral", "dogwood", "esker"]
assert not set(TRAIN_WORDS) & set(WORDS), "training keys must not be eval keys"
QA = tuple[str, str, str]
"""(question, answer prefix, answer)."""
Messages = list[dict[str, str]]


def documents(seed: int, formats: list[str], min_chars: int, max_chars: int) -> Iterator[tuple[str, str]]:
    """(id, text) forever: formats in turn, lengths log-uniform in [min_chars, max_chars], the
    needles at uniform depths. Sources of other lengths draw other documents."""
    for id_, context, qas in _drawn(seed, formats, min_chars, max_chars):
        yield id_, context + "\n\n" + "\n\n".join(f"{q}\n{prefix} {a}." for q, prefix, a in qas)


def conversations(seed: int, formats: list[str], min_chars: int, max_chars: int) -> Iterator[tuple[str, Messages]]:
    """The same documents as chats, for SFT: the user gives the context and asks, the assistant
    answers as eval prompts a chat model (suite.Encoder: the answer prefix, then the answer); a
    multiquery document asks its further questions in further turns."""
    for id_, context, qas in _drawn(seed, formats, min_chars, max_chars):
        turns: Messages = []
        for i, (question, prefix, answer) in enumerate(qas):
            turns.append({"role": "user", "content": f"{context}\n\n{question}" if i == 0 else question})
            turns.append({"role": "assistant", "content": f"{prefix} {answer}."})
        yield id_, turns


def _drawn(seed: int, formats: list[str], min_chars: int, max_chars: int) -> Iterator[tuple[str, str, list[QA]]]:
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown:
        raise ValueError(f"synthetic formats {unknown} are unknown (known: {list(FORMATS)})")
    rng = np.random.default_rng([seed, min_chars, max_chars, 7919])
    for i in itertools.count():
        fmt = formats[i % len(formats)]
        chars = int(math.exp(rng.uniform(math.log(min_chars), math.log(max_chars))))
        yield (f"synthetic:{fmt}:{i}", *_document(fmt, chars, rng))


def _document(fmt: str, chars: int, rng: np.random.Generator) -> tuple[str, list[QA]]:
    """The context (filler with the needles) and its questions."""
    if fmt == "passkey":
        digits = PASSKEY_DIGITS[int(rng.integers(len(PASSKEY_DIGITS)))]
        key = str(int(rng.integers(10 ** (digits - 1), 10 ** digits)))
        needles, qas = [passkey_needle(key)], [(*PASSKEY_ASK, key)]
    else:
        n = {"kv": 1, "multikey": 4}.get(fmt) or min(8, max(2, chars // MULTIQUERY_CHARS))
        keys = list(dict.fromkeys(_key(rng) for _ in range(n)))
        values = [str(int(rng.integers(1_000_000, 10_000_000))) for _ in keys]
        needles = [niah_needle(k, v) for k, v in zip(keys, values, strict=True)]
        asked = rng.permutation(len(keys)) if fmt == "multiquery" else [int(rng.integers(len(keys)))]
        qas = [(*niah_ask([keys[i]]), values[i]) for i in asked]
    qa_chars = sum(len(q) + len(prefix) + len(a) + 3 for q, prefix, a in qas) + 2 * (len(qas) - 1)
    room = max(0, chars - qa_chars - sum(map(len, needles)))
    filler = [NOISE] * max(1, room // len(NOISE))
    for needle in needles:
        filler.insert(int(rng.integers(len(filler) + 1)), needle)
    return "".join(filler), qas


def _key(rng: np.random.Generator) -> str:
    return f"{TRAIN_WORDS[int(rng.integers(len(TRAIN_WORDS)))]}-{TRAIN_WORDS[int(rng.integers(len(TRAIN_WORDS)))]}"
