"""Figures written to files (no display): one place for the backend and the finishing touches."""

from __future__ import annotations

from pathlib import Path


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: Path) -> None:
    if fig.get_layout_engine() is None:  # a figure made with its own layout (constrained) keeps it
        fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)


def labels(ax, xlabel: str, ylabel: str, title: str, outside: bool = False) -> None:
    """Label one axes and add its legend (`outside`: beside the axes, where it covers no line; the
    figure's layout "constrained" makes room for it)."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if outside:
        ax.figure.legend(loc="outside right upper", fontsize=8)
    else:
        ax.legend(fontsize=8)


def finish(fig, ax, path: Path, xlabel: str, ylabel: str, title: str) -> None:
    """Label one axes, add its legend, write the figure."""
    labels(ax, xlabel, ylabel, title)
    save(fig, path)


def notice(path: Path, title: str, text: str) -> None:
    """A figure that says why there is no plot (a stage that skipped its work still writes its plots)."""
    fig = pyplot().figure(figsize=(6, 2))
    fig.text(0.5, 0.62, title, ha="center", fontsize=12)
    fig.text(0.5, 0.35, text, ha="center", fontsize=9, wrap=True)
    save(fig, path)


SMOOTHING = 20
"""Steps in the loss curve's running mean."""


def loss_curve(rows: list[dict], title: str, val_loss: float | None = None, marks: dict[int, str] | None = None):
    """A training stage's loss by step: the mean of the last SMOOTHING steps drawn first and on
    top, each step's loss faint beneath it (it swings 0.1-4.5 on the tiny run), its final
    validation loss and `marks` (step: label, e.g. where a curriculum changes split), the legend
    beside the axes: what a person opens first to see whether a run trained."""
    import numpy as np

    fig, ax = pyplot().subplots(figsize=(9, 4.2), layout="constrained")
    steps = np.array([r["step"] for r in rows], dtype=float)
    loss = np.array([r["loss"] for r in rows], dtype=float)
    # each step's mean over itself and the SMOOTHING - 1 before it (fewer at the start)
    mean = np.convolve(loss, np.ones(SMOOTHING))[:len(loss)] / np.minimum(np.arange(1, len(loss) + 1), SMOOTHING) \
        if len(loss) else loss
    ax.plot(steps, mean, color="tab:blue", linewidth=2.2, zorder=3, label=f"train loss ({SMOOTHING}-step mean)")
    ax.plot(steps, loss, color="tab:blue", alpha=0.25, linewidth=0.7, zorder=2, label="train loss (each step)")
    if val_loss is not None and len(steps):
        ax.plot([steps[-1]], [val_loss], "o", color="tab:red", zorder=4, label=f"validation loss {val_loss:.3f}")
    for step, label in (marks or {}).items():
        ax.axvline(step, color="0.4", linestyle="--", linewidth=1, label=label)
    labels(ax, "step", "loss (nats/token)", title, outside=True)
    return fig
