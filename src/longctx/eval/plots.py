"""The evaluation's figures: task score against length, loss by position, the NIAH grid."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..plotting import labels, pyplot, save
from . import tasks
from .report import BEYOND, beyond

MARKERS = "osD^vP*X"


def score_vs_length(scores: dict[str, dict[str, dict[int, float]]], path: Path,
                    windows: dict[str, int | None] | None = None, spread: dict | None = None) -> None:
    """Mean score over tasks against context length, one line per checkpoint (`score_lines`;
    `windows`: checkpoint -> trained length; `spread`: the results' `means`, drawn as 95% bars)."""
    save(score_figure(scores, windows, spread), path)


def score_figure(scores: dict[str, dict[str, dict[int, float]]], windows: dict[str, int | None] | None = None,
                 spread: dict | None = None):
    fig, ax = pyplot().subplots(figsize=(7, 4.2))
    score_lines(ax, scores, windows or {}, spread)
    title = "Long-context tasks against length" + (" (bars: 95% intervals over prompts)" if spread else "")
    labels(ax, "context length (tokens)", "mean task score", title)
    return fig


def family_figure(scores: dict[str, dict[str, dict[int, float]]], windows: dict[str, int | None] | None = None):
    """The comparison view: one panel per task family (tasks.FAMILIES), in each the family's mean
    score against length, one line per checkpoint."""
    order = [*tasks.FAMILIES, "HELMET data"]
    families = sorted({tasks.family(t) for by_task in scores.values() for t in by_task}, key=order.index) or ["none"]
    cols = min(2, len(families))
    rows = -(-len(families) // cols)
    fig, axes = pyplot().subplots(rows, cols, figsize=(5.6 * cols, 3.8 * rows), squeeze=False, layout="constrained")
    for ax, name in zip(axes.flat, families, strict=False):
        part = {c: {t: by for t, by in by_task.items() if tasks.family(t) == name} for c, by_task in scores.items()}
        score_lines(ax, {c: by for c, by in part.items() if by}, windows or {})
        labels(ax, "context length (tokens)", "mean score", name)
    for ax in axes.flat[len(families):]:
        ax.set_visible(False)
    fig.suptitle("Scores by task family: each checkpoint against context length")
    return fig


def score_lines(ax, scores: dict[str, dict[str, dict[int, float]]], windows: dict[str, int | None],
                spread: dict | None = None) -> None:
    """Mean score over the given tasks against length (log2 axis), one line per checkpoint. Lines
    that would lie on top of each other stay visible: each checkpoint has its own marker and a small
    sideways offset, and a checkpoint whose scores equal an earlier one's says so in the legend.
    Scores beyond a checkpoint's window have hollow markers; `spread` (checkpoint -> length ->
    {lo, hi}) adds each point's interval as a bar. Lengths may be JSON's strings."""
    seen: dict[tuple, str] = {}
    hollow = False
    for i, (ckpt, by_task) in enumerate(scores.items()):
        lengths = sorted({int(n) for by in by_task.values() for n in by})
        means = [float(np.mean([v for by in by_task.values() for m, v in by.items() if int(m) == n]))
                 for n in lengths]
        key = (tuple(lengths), tuple(round(m, 6) for m in means))
        label = ckpt if key not in seen else f"{ckpt} (same as {seen[key]})"
        seen.setdefault(key, ckpt)
        shift = 2 ** (0.04 * (i - (len(scores) - 1) / 2))  # x is log2: a constant ratio is a constant offset
        marker = MARKERS[i % len(MARKERS)]
        (line,) = ax.plot([n * shift for n in lengths], means, marker=marker, alpha=0.85, label=label)
        bars = {int(n): v for n, v in (spread or {}).get(ckpt, {}).items()}
        if at := [(n * shift, m, bars[n]) for n, m in zip(lengths, means, strict=True) if n in bars]:
            x, y, cell = zip(*at, strict=True)
            ax.errorbar(x, y, yerr=[[max(0.0, m - c["lo"]) for m, c in zip(y, cell, strict=True)],
                                    [max(0.0, c["hi"] - m) for m, c in zip(y, cell, strict=True)]],
                        linestyle="none", color=line.get_color(), capsize=3, alpha=0.6)
        out = [(n * shift, m) for n, m in zip(lengths, means, strict=True) if beyond(windows, ckpt, n)]
        if out:
            hollow = True
            ax.plot(*zip(*out, strict=True), linestyle="none", marker=marker, markerfacecolor="white",
                    color=line.get_color(), zorder=line.get_zorder() + 1)
    if hollow:
        ax.plot([], [], linestyle="none", marker="o", markerfacecolor="white", color="grey",
                label="hollow: beyond the checkpoint's window")
    ax.set_xscale("log", base=2)
    ax.set_ylim(-0.02, 1.02)


def position_loss(rows: list[dict], path: Path, train_len: int | None = None) -> None:
    """Loss by token position (FoX paper Figure 2), one line per checkpoint; a dashed line at the
    length they were trained at, where extrapolation starts."""
    save(position_figure(rows, train_len), path)


def position_figure(rows: list[dict], train_len: int | None = None):
    fig, ax = pyplot().subplots(figsize=(7, 4.2))
    for ckpt in dict.fromkeys(r["checkpoint"] for r in rows):
        pts = [(r["position"], r["loss"]) for r in rows if r["checkpoint"] == ckpt]
        ax.plot([p for p, _ in pts], [v for _, v in pts], label=ckpt)
    if train_len:
        ax.axvline(train_len, color="0.4", linestyle="--", linewidth=1, label=f"training length ({train_len})")
    labels(ax, "token position", "loss (window mean)", "Loss by position")
    return fig


def niah_heatmap(rows: list[dict], path: Path, windows: dict[str, int | None] | None = None) -> None:
    """Single-needle (noise haystack) score by depth x length, one panel per checkpoint, each
    cell's mean score over its prompts written in it (with a * beyond the checkpoint's window) and the colour scale
    beside the panels."""
    save(niah_figure(rows, windows), path)


def niah_figure(rows: list[dict], windows: dict[str, int | None] | None = None):
    windows = windows or {}
    cells = [r for r in rows if r["task"] == "niah_single_noise"]
    ckpts = list(dict.fromkeys(r["checkpoint"] for r in cells)) or ["none"]
    cols = min(2, len(ckpts))
    rows = -(-len(ckpts) // cols)
    fig, axes = pyplot().subplots(rows, cols, figsize=(4.4 * cols + 1.0, 3.4 * rows), squeeze=False,
                                  layout="constrained")
    lengths = sorted({r["length"] for r in cells})
    depths = sorted({r["depth"] for r in cells})
    image = None
    for ax, ckpt in zip(axes.flat, ckpts, strict=False):
        total, count = np.zeros((len(depths), len(lengths))), np.zeros((len(depths), len(lengths)))
        for r in cells:
            if r["checkpoint"] == ckpt:
                at = depths.index(r["depth"]), lengths.index(r["length"])
                total[at] += r["score"]
                count[at] += 1
        grid = np.where(count > 0, total / np.maximum(count, 1), np.nan)
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        for (y, x), v in np.ndenumerate(grid):
            mark = BEYOND if beyond(windows, ckpt, lengths[x]) else ""
            ax.text(x, y, "-" if np.isnan(v) else f"{v:.2f}{mark}", ha="center", va="center", fontsize=10)
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=9)
        ax.set_yticks(range(len(depths)), [f"{d:.2f}" for d in depths], fontsize=9)
        past = bool(lengths) and beyond(windows, ckpt, lengths[-1])
        ax.set_title(f"{ckpt} (window {windows[ckpt]}; {BEYOND} beyond)" if past else ckpt, fontsize=10)
        ax.set_xlabel("length")
    for ax in axes.flat[len(ckpts):]:
        ax.set_visible(False)
    for row in axes:
        row[0].set_ylabel("needle depth")
    fig.suptitle("NIAH single needle in a noise haystack (niah_single_noise): score by depth and length")
    fig.colorbar(image, ax=list(axes.flat), label="score", shrink=0.9)
    return fig
