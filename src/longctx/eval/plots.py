"""The evaluation's figures: task score against length, loss by position, the NIAH grid."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..plotting import finish, pyplot, save


def score_vs_length(scores: dict[str, dict[str, dict[int, float]]], path: Path) -> None:
    """Mean score over tasks against context length, one line per checkpoint."""
    fig, ax = pyplot().subplots(figsize=(7, 4.2))
    for ckpt, by_task in scores.items():
        lengths = sorted({n for by in by_task.values() for n in by})
        means = [np.mean([by[n] for by in by_task.values() if n in by]) for n in lengths]
        ax.plot(lengths, means, marker="o", label=ckpt)
    ax.set_xscale("log", base=2)
    ax.set_ylim(-0.02, 1.02)
    finish(fig, ax, path, "context length (tokens)", "mean task score", "Long-context tasks against length")


def position_loss(rows: list[dict], path: Path) -> None:
    """Loss by token position (FoX paper Figure 2), one line per checkpoint."""
    fig, ax = pyplot().subplots(figsize=(7, 4.2))
    for ckpt in dict.fromkeys(r["checkpoint"] for r in rows):
        pts = [(r["position"], r["loss"]) for r in rows if r["checkpoint"] == ckpt]
        ax.plot([p for p, _ in pts], [v for _, v in pts], label=ckpt)
    finish(fig, ax, path, "token position", "loss (window mean)", "Loss by position")


def niah_heatmap(rows: list[dict], path: Path) -> None:
    """Single-needle (noise haystack) score by depth x length, one panel per checkpoint."""
    cells = [r for r in rows if r["task"] == "niah_single_noise"]
    ckpts = list(dict.fromkeys(r["checkpoint"] for r in cells)) or ["none"]
    fig, axes = pyplot().subplots(1, len(ckpts), figsize=(3.2 * len(ckpts), 3.2), squeeze=False)
    lengths = sorted({r["length"] for r in cells})
    depths = sorted({r["depth"] for r in cells})
    for ax, ckpt in zip(axes[0], ckpts, strict=True):
        grid = np.full((len(depths), len(lengths)), np.nan)
        for r in cells:
            if r["checkpoint"] == ckpt:
                grid[depths.index(r["depth"]), lengths.index(r["length"])] = r["score"]
        ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:.2f}" for d in depths], fontsize=7)
        ax.set_title(ckpt, fontsize=9)
        ax.set_xlabel("length")
    axes[0][0].set_ylabel("needle depth")
    save(fig, path)
