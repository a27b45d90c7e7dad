"""HELMET's dataset categories on small local fixtures the test writes (JSONL in HELMET's field
layout): loading with field renames, prompt building at a length, and each category's metric."""

from __future__ import annotations

import json

import numpy as np
import pytest

from longctx.data.tokenizer import TextTokenizer
from longctx.errors import DataError
from longctx.eval import helmet, tasks
from longctx.eval.suite import Encoder

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def enc(small_project) -> Encoder:
    return Encoder(TextTokenizer.load(small_project / "data/tokens/tokenizer"), chat=False)


def passages(rng, n, answer):
    out = []
    for i in range(n):
        text = " ".join(rng.choice(WORDS, 30))
        out.append({"id": f"p{i}", "title": f"T{i}", "text": text + (f" The answer is {answer}." if i == 3 else ""),
                    "has_answer": i == 3, "label": 2 if i == 3 else int(i % 5 == 0)})
    return out


def test_icl_relabels_and_balances(enc, tmp_path):
    rows = [{"sentence": f"question about {w} number {i}", "coarse_label": i % 6} for i, w in
            enumerate(WORDS * 10)]
    src = helmet.Source("icl", jsonl(tmp_path / "trec.jsonl", rows),
                        fields={"text": "sentence", "label": "coarse_label"})
    loaded = helmet.load_rows(src, limit=100)
    assert len(loaded) == 100 and {"text", "label"} <= set(loaded[0])
    p = helmet.build(src, loaded, tasks.Budget(enc.count, 1024), np.random.default_rng(0), 0.5, "trec")
    n = len(enc.prompt(p))
    assert 0.85 * 1024 <= n <= 1024
    shown = [int(x) for x in __import__("re").findall(r"label: (\d+)", p.context)]
    counts = np.bincount(shown)
    assert len(set(shown)) == 6 and counts[counts > 0].max() - counts[counts > 0].min() <= 1  # class-balanced
    assert p.gold[0] in map(str, shown) and set(map(str, shown)) != {str(i) for i in range(6)}  # relabelled
    assert tasks.score(p, f" {p.gold[0]}") == 1.0


def test_rag_rerank_and_narrative(enc, tmp_path):
    rng = np.random.default_rng(1)
    rag_rows = [{"question": "what is the answer?", "answers": ["zebra42"], "ctxs": passages(rng, 40, "zebra42")}]
    src = helmet.Source("rag", jsonl(tmp_path / "nq.jsonl", rag_rows))
    p = helmet.build(src, helmet.load_rows(src), tasks.Budget(enc.count, 1024), np.random.default_rng(0), 0.5, "nq")
    assert p.context.count("The answer is zebra42") == 1 and len(enc.prompt(p)) <= 1024
    assert tasks.score(p, "zebra42") == 1.0 and tasks.score(p, "zebra") == 0.0

    rr_rows = [{"query": "q", "ctxs": passages(rng, 12, "x")}]
    src = helmet.Source("rerank", jsonl(tmp_path / "msmarco.jsonl", rr_rows))
    p = helmet.build(src, helmet.load_rows(src), tasks.Budget(enc.count, 4096), np.random.default_rng(0), 0.5, "ms")
    rel = {g.split(":")[0]: int(g.split(":")[1]) for g in p.gold}
    best = " > ".join(f"[{i}]" for i in sorted(rel, key=lambda i: -rel[i]))
    worst = " > ".join(f"[{i}]" for i in sorted(rel, key=lambda i: rel[i]))
    assert tasks.score(p, best) == pytest.approx(1.0) and tasks.score(p, worst) < 0.6

    doc = " ".join(rng.choice(WORDS, 5000))
    src = helmet.Source("narrativeqa", jsonl(tmp_path / "nqa.jsonl", [{"document": doc, "question": "who?",
                                                                      "answers": ["the old sailor"]}]))
    p = helmet.build(src, helmet.load_rows(src), tasks.Budget(enc.count, 1024), np.random.default_rng(0), 0.5, "nqa")
    assert 0.85 * 1024 <= len(enc.prompt(p)) <= 1024 and "not computed" in p.meta["not_computed"]
    assert tasks.score(p, "The old sailor") == 1.0
    assert tasks.score(p, "an old man") == pytest.approx(2 * (1 / 3 * 1 / 3) / (2 / 3))  # LCS "old": P = R = 1/3


def test_unloadable_dataset_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="cannot load split 'test'"):
        helmet.load_rows(helmet.Source("rag", str(tmp_path / "missing.jsonl")))
