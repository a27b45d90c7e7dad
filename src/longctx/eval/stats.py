"""How far a task score could move, and whether one checkpoint beat another on the same prompts.

A cell's score is the mean over its prompts. Where every prompt scores 0 or 1 (accuracy-type
metrics) its 95% interval is Wilson's score interval; graded scores (ROUGE-L, NDCG, the fraction
of keys found) get a percentile bootstrap over prompts. A mean over tasks combines the tasks'
intervals (`mean_interval`). Two checkpoints answered the same prompts,
so they are compared pairwise: an exact two-sided sign test over the prompts where their scores
differ (McNemar's exact test when scores are 0/1).
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np

Z95 = 1.959963984540054
LEVEL = 0.95

Verdict = Literal["better", "worse", "no difference"]


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson's score interval for k successes in n trials (n = 50, k = 25: 0.366-0.634)."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def bootstrap(scores: list[float], draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of graded scores, resampled over prompts."""
    x = np.asarray(scores, dtype=float)
    if len(x) == 0:
        return 0.0, 1.0
    means = x[np.random.default_rng(seed).integers(len(x), size=(draws, len(x)))].mean(1)
    lo, hi = np.quantile(means, [(1 - LEVEL) / 2, (1 + LEVEL) / 2])
    return float(lo), float(hi)


def interval(scores: list[float]) -> tuple[float, float]:
    """The 95% interval of a cell's mean score: Wilson when every score is 0 or 1, else bootstrap."""
    if all(s in (0.0, 1.0) for s in scores):
        return wilson(int(sum(scores)), len(scores))
    return bootstrap(scores)


def mean_interval(groups: list[list[float]]) -> tuple[float, float]:
    """The 95% interval of the mean of several cells' mean scores (a length's mean over tasks).
    0/1 scores in cells of one size: Wilson's over all their prompts (the mean over tasks is then
    the mean over prompts). Else each cell's own interval read as a normal spread and the spreads
    combined, clipped to [0, 1]: a resampling of prompts would call a cell whose prompts all
    scored alike certain (10 right of 10 is 0.72-1 to Wilson, 1-1 to a bootstrap)."""
    if len(groups) == 1:
        return interval(groups[0])
    flat = [s for g in groups for s in g]
    if len({len(g) for g in groups}) == 1 and all(s in (0.0, 1.0) for s in flat):
        return wilson(int(sum(flat)), len(flat))
    mean = float(np.mean([np.mean(g) for g in groups]))
    half = Z95 * math.sqrt(sum(((hi - lo) / (2 * Z95)) ** 2 for lo, hi in map(interval, groups))) / len(groups)
    return max(0.0, mean - half), min(1.0, mean + half)


def sign_test(wins: int, losses: int) -> float:
    """Exact two-sided p-value of `wins` against `losses` under no difference (ties dropped)."""
    n = wins + losses
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(wins, losses) + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired(new: list[float], old: list[float]) -> dict:
    """`new` against `old`, the same prompts in the same order: wins, losses, the sign test's p
    and the verdict at 95%."""
    if len(new) != len(old):
        raise ValueError(f"a paired test needs the same prompts: {len(new)} scores against {len(old)}")
    wins = sum(a > b for a, b in zip(new, old, strict=True))
    losses = sum(a < b for a, b in zip(new, old, strict=True))
    p = sign_test(wins, losses)
    verdict: Verdict = "no difference" if p >= 1 - LEVEL else "better" if wins > losses else "worse"
    return {"n": len(new), "wins": wins, "losses": losses, "p": p, "verdict": verdict}
