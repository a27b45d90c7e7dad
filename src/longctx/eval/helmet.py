"""HELMET's dataset-based categories, built into the same `Prompt`s as the synthetic tasks:

  icl        TREC / BANKING77 / CLINC150 / NLU: class-balanced demonstrations whose labels are
             replaced by random integers (per prompt), accuracy
  rag        KILT NQ / TriviaQA / HotpotQA / PopQA: the gold passage among distractors filled
             to the length, substring exact match against any answer
  rerank     MS MARCO: rank the passages, NDCG@10 of the ranking read from the output
  narrativeqa  a book (truncated to the length) and a question: ROUGE-L F1 (the GPT-4o judge
             is not computed)
  summ       Multi-LexSum: ROUGE-L F1 against the summary (the GPT-4o judge is not computed)

Rows come from `datasets.load_dataset` (a hub id, a local directory or JSON/JSONL files); field
names are HELMET's processed files' and can be remapped per dataset.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..config import EvalParams
from ..errors import DataError
from .tasks import Budget, Prompt, fitting

KINDS = ("icl", "rag", "rerank", "narrativeqa", "summ")
JUDGED = {"narrativeqa": "GPT-4o judge (HELMET) not computed; ROUGE-L F1 reported",
          "summ": "GPT-4o judge (HELMET) not computed; ROUGE-L F1 reported"}


@dataclass(frozen=True)
class Source:
    kind: str
    path: str
    split: str = "test"
    fields: dict[str, str] = field(default_factory=dict)
    """Our field name -> the dataset's (text, label, question, answers, ctxs, query, document, summary)."""


def load_rows(src: Source, limit: int | None = None) -> list[dict]:
    """Rows of a dataset, with fields renamed to ours."""
    import datasets

    try:
        if src.path.endswith((".json", ".jsonl")):
            ds = datasets.load_dataset("json", data_files={src.split: src.path}, split=src.split)
        else:
            ds = datasets.load_dataset(src.path, split=src.split)
    except Exception as e:  # hub, network and format errors come in many types
        raise DataError(f"{src.path}: cannot load split {src.split!r}: {e}") from None
    rows = ds.select(range(min(limit, len(ds)))) if limit else ds
    rename = {theirs: ours for ours, theirs in src.fields.items()}
    return [{rename.get(k, k): v for k, v in r.items()} for r in rows]


def icl(rows: list[dict], budget: Budget, rng: np.random.Generator, name: str) -> Prompt:
    labels = sorted({str(r["label"]) for r in rows})
    ids = dict(zip(labels, (str(int(x)) for x in rng.choice(10 * len(labels), len(labels), replace=False)),
                   strict=True))
    by_label = {lab: [r["text"] for r in rows if str(r["label"]) == lab] for lab in labels}
    test = rows[int(rng.integers(len(rows)))]
    question = f"text: {test['text']}"
    intro = "Use the provided mapping from the text to label to assign a label to the text.\n\n"

    def demos(n: int) -> list[str]:
        order = [labels[i % len(labels)] for i in range(n)]  # class-balanced
        r = np.random.default_rng(n)
        out = [f"text: {by_label[lab][int(r.integers(len(by_label[lab])))]}\nlabel: {ids[lab]}\n\n" for lab in order]
        return [out[i] for i in r.permutation(n)]

    shots = budget.fill(intro + question + "\nlabel:", demos)
    return Prompt(f"icl_{name}", budget.length, intro + "".join(shots), question, "label:",
                  [ids[str(test["label"])]], "accuracy", 4, {"shots": len(shots)})


def _passage(c: dict, with_id: bool = False) -> str:
    head = f"[ID: {c['id']}] " if with_id else ""
    return f"{head}Document (Title: {c.get('title', '')}): {c['text']}\n\n"


def rag(row: dict, budget: Budget, rng: np.random.Generator, depth: float, name: str) -> Prompt:
    ctxs = list(row["ctxs"])
    gold = [c for c in ctxs if c.get("has_answer")] or ctxs[:1]
    others = [c for c in ctxs if c not in gold]
    question = f"Question: {row['question']}"
    prefix = "Answer:"
    intro = "Use the given documents to write a concise and short answer to the question.\n\n"
    picked = budget.fill(intro + _passage(gold[0]) + question + prefix,
                         lambda n: [_passage(others[i % len(others)]) if others else "" for i in range(n)])
    docs = picked[:]
    docs.insert(int(round(depth * len(docs))), _passage(gold[0]))
    answers = row["answers"] if isinstance(row["answers"], list) else [row["answers"]]
    return Prompt(f"rag_{name}", budget.length, intro + "".join(docs), question, prefix, [str(a) for a in answers],
                  "any", 24, {"depth": depth})


def rerank(row: dict, budget: Budget, rng: np.random.Generator, name: str) -> Prompt:
    ctxs = [c for c in row["ctxs"]]
    order = rng.permutation(len(ctxs))
    question = f"Query: {row['query']}"
    prefix = "Ranking:"
    intro = ("You are provided with a list of documents, each indicated by their ID. Rank each document based on "
             "their relevance to the question in descending order from most relevant to least relevant. Use the "
             "format: [ID] > [ID] > ...\n\n")
    docs = budget.fill(intro + question + prefix, lambda n: [_passage(ctxs[order[i % len(ctxs)]], True)
                                                            for i in range(min(n, len(ctxs)))])
    shown = [ctxs[order[i]] for i in range(len(docs))]
    gold = [f"{c['id']}:{int(c.get('label', 0))}" for c in shown]
    return Prompt(f"rerank_{name}", budget.length, intro + "".join(docs), question, prefix, gold, "ndcg10", 200)


def narrative(row: dict, budget: Budget, kind: str, name: str) -> Prompt:
    """A long document truncated to the length, a question (narrativeqa) or a summary request."""
    if kind == "narrativeqa":
        question, prefix, gold = f"Question: {row['question']}", "Answer:", row["answers"]
    else:
        question, prefix, gold = "Summarize the legal case above.", "Summary:", [row["summary"]]
    words = row["document"].split(" ")
    kept = budget.fill(question + prefix, lambda n: [w + " " for w in words[:n]])
    return Prompt(f"{kind}_{name}", budget.length, "".join(kept), question, prefix,
                  [str(g) for g in (gold if isinstance(gold, list) else [gold])], "rouge_l",
                  64 if kind == "narrativeqa" else 400, {"not_computed": JUDGED[kind]})


def build(src: Source, rows: list[dict], budget: Budget, rng: np.random.Generator, depth: float,
          name: str) -> Prompt:
    if src.kind == "icl":
        return icl(rows, budget, rng, name)
    row = rows[int(rng.integers(len(rows)))]
    if src.kind == "rag":
        return rag(row, budget, rng, depth, name)
    if src.kind == "rerank":
        return rerank(row, budget, rng, name)
    if src.kind in ("narrativeqa", "summ"):
        return narrative(row, budget, src.kind, name)
    raise ValueError(f"unknown HELMET kind {src.kind!r} (known: {KINDS})")


def prompts(results: dict, name: str, count: Callable[[str], int], ec: EvalParams, lengths: list[int]) -> list[Prompt]:
    """HELMET dataset prompts for checkpoint `name`; a dataset that cannot be loaded is skipped
    with the reason (in results), so one missing download does not stop the evaluation."""
    out = []
    for ds_name, spec in ec.helmet.items():
        src = Source(spec.kind, spec.path, spec.split, dict(spec.fields))
        try:
            rows = load_rows(src, spec.limit)
        except DataError as e:
            results["skipped"].append({"checkpoint": name, "task": f"helmet:{ds_name}", "reason": str(e)[:300]})
            continue
        for length in lengths:
            for i in range(ec.samples):
                rng = np.random.default_rng([ec.seed, length, i, len(ds_name)])
                budget = Budget(count, length, reserve=24)
                with fitting(f"helmet:{ds_name}", budget):
                    out.append(build(src, rows, budget, rng, ec.depths[i % len(ec.depths)], ds_name))
        if spec.kind in JUDGED:
            results["not_computed"][f"helmet:{ds_name}"] = JUDGED[spec.kind]
    return out
