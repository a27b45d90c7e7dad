"""How a task's output is scored against its gold answers, by the metric of the task's source:
  substring  the (single) gold string appears in the output (HELMET's substring exact match)
  all        the fraction of gold strings that appear in the output (RULER's string_match_all;
             1.0 means all gold present)
  accuracy   the output's first integer equals the gold label (HELMET ICL)
  any        any gold string appears (HELMET RAG)
  ndcg10     NDCG@10 of the ranking read from the output (HELMET rerank)
  rouge_l    ROUGE-L F1 (HELMET narrativeqa and summarization; their GPT-4o judge is not computed)
Each takes the gold strings and the output and returns a score in [0, 1].
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable


def substring(gold: list[str], output: str) -> float:
    return float(gold[0] in output)


def any_gold(gold: list[str], output: str) -> float:
    return float(any(g in output for g in gold))


def all_gold(gold: list[str], output: str) -> float:
    return sum(g in output for g in gold) / len(gold)


def accuracy(gold: list[str], output: str) -> float:
    found = re.search(r"-?\d+", output)
    return float(found is not None and found.group() == gold[0])


def ndcg10(gold: list[str], output: str) -> float:
    """NDCG@10 of the ranking in the output ("[ID] > [ID] ..."), relevance from the gold labels."""
    rel = {g.rsplit(":", 1)[0]: int(g.rsplit(":", 1)[1]) for g in gold}
    ranked = [i for i in dict.fromkeys(re.findall(r"[\w-]+", output)) if i in rel][:10]
    dcg = sum(rel[i] / math.log2(k + 2) for k, i in enumerate(ranked))
    ideal = sum(r / math.log2(k + 2) for k, r in enumerate(sorted(rel.values(), reverse=True)[:10]))
    return dcg / ideal if ideal else 0.0


def rouge_l(gold: list[str], output: str) -> float:
    """Best ROUGE-L F1 (longest common subsequence of lower-cased words) over the references."""
    out = output.lower().split()
    best = 0.0
    for ref in gold:
        r = ref.lower().split()
        if not r or not out:
            continue
        prev = [0] * (len(r) + 1)
        for w in out:
            cur = [0]
            for j, x in enumerate(r):
                cur.append(prev[j] + 1 if w == x else max(prev[j + 1], cur[j]))
            prev = cur
        lcs = prev[-1]
        if lcs:
            p, rc = lcs / len(out), lcs / len(r)
            best = max(best, 2 * p * rc / (p + rc))
    return best


METRICS: dict[str, Callable[[list[str], str], float]] = {
    "substring": substring, "all": all_gold, "accuracy": accuracy, "any": any_gold, "ndcg10": ndcg10,
    "rouge_l": rouge_l}
