"""The eval results (metrics/eval.json: one section per measurement, each keyed by checkpoint)
and the tables read from them: the eval stage's comparison, the pipeline's closing summary and
the sweep's mean score all read the per-length scores through `score_rows`."""

from __future__ import annotations

import numpy as np


def empty_results() -> dict:
    """The sections every checkpoint's measurements go into; what cannot be computed says why."""
    return {"tasks": {}, "throughput": {}, "position_loss": {}, "ppl_by_length": {}, "needle_ppl": {},
            "retention_ppl": {}, "skipped": [], "windows": {},
            "not_computed": {"helmet_gpt4o_judged": "GPT-4o-judged metrics (HELMET summarization, QA "
                                                    "judge) need an external API; not computed"}}


def mean_scores(rows: list[dict]) -> dict[str, dict[int, float]]:
    """Task -> length -> mean score of the prompt rows (the `tasks` section of one checkpoint)."""
    out: dict[str, dict[int, list[float]]] = {}
    for r in rows:
        out.setdefault(r["task"], {}).setdefault(r["length"], []).append(r["score"])
    return {t: {n: float(np.mean(v)) for n, v in by.items()} for t, by in out.items()}


def score_rows(tasks: dict) -> list[dict]:
    """The `tasks` section (checkpoint -> task -> length -> score; lengths are strings once read
    back from JSON) as one row per checkpoint, task and length: the per-length score table."""
    return [{"checkpoint": c, "task": t, "length": int(n), "score": v}
            for c, by_task in tasks.items() for t, by in by_task.items() for n, v in by.items()]


BEYOND = "*"
"""Marks a score measured beyond the checkpoint's window."""


def beyond(windows: dict[str, int | None], ckpt: str, n: int | str) -> bool:
    """Whether length n is past the window `ckpt` was trained to (`windows`: the results'
    checkpoint -> trained length, None for no limit; lengths may be JSON's strings)."""
    window = windows.get(ckpt)
    return window is not None and int(n) > window


def length_means(tasks: dict) -> tuple[list[int], dict[str, dict[int, float]]]:
    """Every length scored, and each checkpoint's mean task score at each of its lengths (a length
    beyond a checkpoint's window is absent)."""
    rows = score_rows(tasks)
    by_length: dict[str, dict[int, list[float]]] = {c: {} for c in tasks}
    for r in rows:
        by_length[r["checkpoint"]].setdefault(r["length"], []).append(r["score"])
    means = {c: {n: float(np.mean(v)) for n, v in by.items()} for c, by in by_length.items()}
    return sorted({r["length"] for r in rows}), means


def comparison(results: dict) -> str:
    """A Markdown table: each checkpoint's mean task score per length and retention (no
    throughput: the file is a DVC output, and a rerun must write the same bytes)."""
    lengths, means = length_means(results["tasks"])
    head = ["checkpoint", *[f"tasks@{n}" for n in lengths], "retention ppl"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    windows = results.get("windows", {})
    for c, by_length in means.items():
        cells = [c, *(f"{by_length[n]:.3f}{BEYOND if beyond(windows, c, n) else ''}" if n in by_length
                      else "skipped" for n in lengths)]
        ret = results["retention_ppl"].get(c)
        cells.append(f"{ret:.2f}" if ret else "n/a")
        lines.append("| " + " | ".join(cells) + " |")
    if any(beyond(windows, c, n) for c, by in means.items() for n in by):
        lines.append(f"\n{BEYOND} beyond the checkpoint's window (the length it was trained to)")
    return "\n".join(lines) + "\n"
