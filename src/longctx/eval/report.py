"""The eval results (metrics/eval.json: one section per measurement, each keyed by checkpoint)
and the tables read from them: the eval stage's comparison, the pipeline's closing summary and
the sweep's mean score all read the per-length scores through `score_rows`."""

from __future__ import annotations

import re

import numpy as np

from . import stats
from .tasks import held_out


def empty_results() -> dict:
    """The sections every checkpoint's measurements go into; what cannot be computed says why."""
    return {"tasks": {}, "throughput": {}, "position_loss": {}, "ppl_by_length": {}, "needle_ppl": {},
            "retention_ppl": {}, "skipped": [], "windows": {}, "cells": {}, "means": {}, "verdicts": {}, "best": {},
            "formats": {}, "near_misses": {},
            "not_computed": {"helmet_gpt4o_judged": "GPT-4o-judged metrics (HELMET summarization, QA "
                                                    "judge) need an external API; not computed"}}


def merge_checkpoint(results: dict, scored: dict) -> None:
    """Add one checkpoint's sections (an `empty_results` that `suite.evaluate` filled) to the run's."""
    for section, value in scored.items():
        if isinstance(value, list):
            results.setdefault(section, []).extend(value)
        else:
            results.setdefault(section, {}).update(value)


def int_keys(obj):
    """`obj` read back from JSON, its lengths (written as "4096") int keys again, as measured."""
    if isinstance(obj, dict):
        return {int(k) if k.isdigit() else k: int_keys(v) for k, v in obj.items()}
    return [int_keys(v) for v in obj] if isinstance(obj, list) else obj


def mean_scores(rows: list[dict]) -> dict[str, dict[int, float]]:
    """Task -> length -> mean score of the prompt rows (the `tasks` section of one checkpoint)."""
    out: dict[str, dict[int, list[float]]] = {}
    for r in rows:
        out.setdefault(r["task"], {}).setdefault(r["length"], []).append(r["score"])
    return {t: {n: float(np.mean(v)) for n, v in by.items()} for t, by in out.items()}


def _by_cell(rows: list[dict]) -> dict[tuple[str, int], list[float]]:
    """(task, length) -> the prompts' scores in prompt order."""
    out: dict[tuple[str, int], list[float]] = {}
    for r in rows:
        out.setdefault((r["task"], int(r["length"])), []).append(r["score"])
    return out


def cells(rows: list[dict]) -> dict[str, dict[int, dict]]:
    """Task -> length -> the number of prompts behind the score and its 95% interval (the
    `cells` section of one checkpoint)."""
    out: dict[str, dict[int, dict]] = {}
    for (task, n), scores in _by_cell(rows).items():
        lo, hi = stats.interval(scores)
        out.setdefault(task, {})[n] = {"n": len(scores), "lo": round(lo, 4), "hi": round(hi, 4)}
    return out


def length_cells(rows: list[dict]) -> dict[int, dict]:
    """Length -> the mean task score over the tasks at that length, the prompts behind it and its
    95% interval (`stats.mean_interval`; the `means` section of one checkpoint)."""
    by_length: dict[int, list[list[float]]] = {}
    for (_, n), scores in _by_cell(rows).items():
        by_length.setdefault(n, []).append(scores)
    out = {}
    for n, groups in sorted(by_length.items()):
        lo, hi = stats.mean_interval(groups)
        out[n] = {"mean": round(float(np.mean([np.mean(g) for g in groups])), 4), "n": sum(map(len, groups)),
                  "lo": round(lo, 4), "hi": round(hi, 4)}
    return out


def _shared(new: list[dict], old: list[dict]) -> dict[tuple[str, int], tuple[list[float], list[float]]]:
    """(task, length) -> both sides' scores on the prompts both asked: the first of each cell (a
    run with more eval.samples asks the same prompts first, then more)."""
    a, b = _by_cell(new), _by_cell(old)
    out = {}
    for c in sorted(set(a) & set(b)):
        k = min(len(a[c]), len(b[c]))
        out[c] = a[c][:k], b[c][:k]
    return out


def _pooled(shared: dict[tuple[str, int], tuple[list[float], list[float]]], n: int) -> dict:
    """The paired verdict over every shared prompt of length n, task by task in order."""
    cells = [v for (_, m), v in shared.items() if m == n]
    return stats.paired([s for mine, _ in cells for s in mine], [s for _, theirs in cells for s in theirs])


def paired_rows(new: list[dict], old: list[dict]) -> dict:
    """Per task and length, and over every prompt of a length ("all"), the prompt rows `new`
    against `old` on the prompts both answered (within a run, every checkpoint answered the same
    prompts: the eval builds them once; across runs, see compare.py)."""
    shared = _shared(new, old)
    out: dict = {"all": {n: _pooled(shared, n) for n in sorted({n for _, n in shared})}}
    for (task, n), (mine, theirs) in shared.items():
        out.setdefault(task, {})[n] = stats.paired(mine, theirs)
    return out


def verdicts(rows: list[dict], order: list[str]) -> dict:
    """Each checkpoint after the first against the first (the base) and against the one before
    it: `better`, `worse` or `no difference` at 95% per task and length (the `verdicts` section)."""
    by = {c: [r for r in rows if r["checkpoint"] == c] for c in order}
    out = {}
    for i, c in enumerate(order[1:], start=1):
        out[c] = {"base": {"vs": order[0], **paired_rows(by[c], by[order[0]])}}
        if i > 1:
            out[c]["previous"] = {"vs": order[i - 1], **paired_rows(by[c], by[order[i - 1]])}
    return out


def _edits(a: str, b: str) -> int:
    """Levenshtein distance: insertions, deletions and substitutions from a to b."""
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


def near_misses(rows: list[dict]) -> dict:
    """Checkpoint -> length -> the wrong answers to prompts whose one gold is a number (passkey,
    the NIAHs) and how many of them hold a number within a third of its digits (edits) of it:
    the needle was found and its copy went wrong, a failure of copying rather than of reaching
    that far (the `near_misses` section)."""
    out: dict = {}
    for r in rows:
        gold = r["gold"]
        if r["score"] or len(gold) != 1 or not gold[0].isdigit():
            continue
        cell = out.setdefault(r["checkpoint"], {}).setdefault(int(r["length"]), {"wrong": 0, "near": 0})
        cell["wrong"] += 1
        limit = max(1, len(gold[0]) // 3)
        cell["near"] += any(_edits(n, gold[0]) <= limit for n in re.findall(r"\d+", r["output"]))
    return out


GROUPS = {"trained": "trained formats", "held_out": "held-out formats"}
"""The two blocks the tasks are reported in: those whose prompt format some training split's
synthetic documents write, and the rest (tasks.TAUGHT_BY)."""


def format_groups(rows: list[dict], order: list[str], formats: list[str]) -> dict:
    """The `formats` section: the run's synthetic training formats, its tasks in the two GROUPS,
    and per group each checkpoint's mean score per length with its 95% interval and, after the
    first (the base), its verdict against the base over every prompt of the group and length."""
    names = list(dict.fromkeys(r["task"] for r in rows))
    tasks = {g: [t for t in names if held_out(t, formats) == (g == "held_out")] for g in GROUPS}
    out: dict = {"trained_formats": formats, "tasks": tasks, "means": {}, "vs_base": {}}
    for g, members in tasks.items():
        by = {c: [r for r in rows if r["checkpoint"] == c and r["task"] in members] for c in order}
        out["means"][g] = {c: length_cells(v) for c, v in by.items() if v}
        shared = {c: _shared(by[c], by[order[0]]) for c in order[1:] if by[c]}
        out["vs_base"][g] = {c: {n: _pooled(s, n) for n in sorted({n for _, n in s})} for c, s in shared.items()}
    return out


def best(rows: list[dict], order: list[str]) -> dict:
    """Per length: the checkpoint with the highest mean task score, and its paired verdict
    against each other checkpoint there; `supported` when it is better than every one at 95%
    (the `best` section: the main command names a best checkpoint only then)."""
    out = {}
    lengths = sorted({int(r["length"]) for r in rows})
    for n in lengths:
        at = {c: [r for r in rows if r["checkpoint"] == c and int(r["length"]) == n] for c in order}
        at = {c: v for c, v in at.items() if v}
        means = {c: length_cells(v)[n]["mean"] for c, v in at.items()}
        leader = max(means, key=means.get)
        against = {c: _pooled(_shared(at[leader], at[c]), n) for c in at if c != leader}
        out[n] = {"checkpoint": leader, "mean": round(means[leader], 4), "against": against,
                  "supported": bool(against) and all(v["verdict"] == "better" for v in against.values())}
    return out


def score_rows(tasks: dict, cells: dict | None = None) -> list[dict]:
    """The `tasks` section (checkpoint -> task -> length -> score; lengths are strings once read
    back from JSON) as one row per checkpoint, task and length: the per-length score table; with
    the `cells` section, each row has its prompts and 95% interval (n, lo, hi) too."""
    rows = [{"checkpoint": c, "task": t, "length": int(n), "score": v}
            for c, by_task in tasks.items() for t, by in by_task.items() for n, v in by.items()]
    for r in rows if cells else ():
        by = cells.get(r["checkpoint"], {}).get(r["task"], {})
        r |= by.get(r["length"], by.get(str(r["length"]), {}))
    return rows


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
    """A Markdown table: each checkpoint's mean task score per length, with its 95% interval and
    prompts, and retention (no throughput: the file is a DVC output, and a rerun must write the
    same bytes); then every task's score, the verdicts against the base, and the loss by
    position."""
    lengths, means = length_means(results["tasks"])
    head = ["checkpoint", *[f"tasks@{n}" for n in lengths], "retention ppl"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    windows = results.get("windows", {})
    spread = results.get("means", {})

    def mean_text(c: str, n: int) -> str:
        if n not in means[c]:
            return "skipped"
        cell = {int(m): v for m, v in spread.get(c, {}).items()}.get(n)
        text = interval_text(means[c][n], cell) if cell else f"{means[c][n]:.3f}"
        return text + (BEYOND if beyond(windows, c, n) else "")

    for c in means:
        cells = [c, *(mean_text(c, n) for n in lengths)]
        ret = results["retention_ppl"].get(c)
        cells.append(f"{ret:.2f}" if ret else "n/a")
        lines.append("| " + " | ".join(cells) + " |")
    if any(beyond(windows, c, n) for c, by in means.items() for n in by):
        lines.append(f"\n\\{BEYOND} beyond the checkpoint's window (the length it was trained to)")  # (not a bullet)
    if results.get("cells"):
        lines += ["", "Each task: score [95% interval] (prompts)", "",
                  "| checkpoint | task | " + " | ".join(f"@{n}" for n in lengths) + " |",
                  "|" + "---|" * (len(lengths) + 2)]
        for c, by_task in results["tasks"].items():
            for t, by in by_task.items():
                cell = {int(n): v for n, v in results["cells"][c][t].items()}
                score = {int(n): v for n, v in by.items()}
                lines.append(f"| {c} | {t} | " + " | ".join(
                    interval_text(score[n], cell[n]) if n in score else "skipped" for n in lengths) + " |")
    if results.get("verdicts"):
        lines += ["", "Against the base, every prompt of a length paired (sign test, 95%): verdict (wins-losses)", "",
                  "| checkpoint | " + " | ".join(f"@{n}" for n in lengths) + " |", "|" + "---|" * (len(lengths) + 1)]
        for c, by in results["verdicts"].items():
            pooled = {int(n): v for n, v in by["base"]["all"].items()}
            lines.append(f"| {c} | " + " | ".join(verdict_text(pooled[n]) if n in pooled else "-" for n in lengths)
                         + " |")
    lines += format_lines(results.get("formats", {}), lengths)
    if misses := results.get("near_misses"):
        lines += ["", "Near misses: wrong answers to the number needles (passkey, NIAH) holding the needle's number "
                  "with at most a third of its digits wrong, of the wrong answers (found, but copied wrong)", "",
                  "| checkpoint | " + " | ".join(f"@{n}" for n in lengths) + " |", "|" + "---|" * (len(lengths) + 1)]
        for c, by in misses.items():
            at = {int(n): v for n, v in by.items()}
            lines.append(f"| {c} | " + " | ".join(f"{at[n]['near']} of {at[n]['wrong']}" if n in at else "-"
                                                  for n in lengths) + " |")
    positions = results.get("position_loss", {})
    if bands := position_bands(positions):
        lines += ["", "Loss by position on long validation documents of a long domain (mean over each band of "
                  "positions)", "", "| checkpoint | documents | " + " | ".join(bands) + " |",
                  "|" + "---|" * (len(bands) + 2)]
        for c, by in positions.items():
            lines.append(f"| {c} | {by.get('documents', '-')} | " + " | ".join(
                f"{by['bands'][b]:.3f}" if b in by.get("bands", {}) else "-" for b in bands) + " |")
    return "\n".join(lines) + "\n"


def format_lines(groups: dict, lengths: list[int]) -> list[str]:
    """comparison.md's block of the `formats` section: each group's mean per checkpoint and length
    and its verdict against the base (nothing when no task is held out)."""
    if not groups.get("tasks", {}).get("held_out"):
        return []
    lines = ["", f"Trained and held-out formats: mean task score [95% interval] (prompts), vs base. The training "
             f"splits' synthetic formats: {', '.join(groups['trained_formats']) or 'none'}; held out (no training "
             f"document in their format): {', '.join(groups['tasks']['held_out'])}", "",
             "| checkpoint | formats | " + " | ".join(f"@{n}" for n in lengths) + " |",
             "|" + "---|" * (len(lengths) + 2)]
    for g, label in GROUPS.items():
        for c, by in groups["means"][g].items():
            by = {int(n): v for n, v in by.items()}
            vs = {int(n): v for n, v in groups["vs_base"][g].get(c, {}).items()}
            lines.append(f"| {c} | {label} | " + " | ".join(
                (interval_text(by[n]["mean"], by[n]) + (f", {verdict_text(vs[n])}" if n in vs else "")) if n in by
                else "skipped" for n in lengths) + " |")
    return lines


def position_bands(position_loss: dict) -> list[str]:
    """The bands of positions the `position_loss` section averages over, in order (none in the
    results of older runs)."""
    return list(dict.fromkeys(b for by in position_loss.values() for b in by.get("bands", {})))


def interval_text(score: float, cell: dict) -> str:
    """`0.82 [0.69-0.90] (50)`."""
    return f"{score:.2f} [{cell['lo']:.2f}-{cell['hi']:.2f}] ({cell['n']})"


def verdict_text(v: dict) -> str:
    return f"{v['verdict']} ({v['wins']}-{v['losses']})"
