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


def labels(ax, xlabel: str, ylabel: str, title: str) -> None:
    """Label one axes and add its legend."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
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


def loss_curve(rows: list[dict], title: str, val_loss: float | None = None, marks: dict[int, str] | None = None):
    """A training stage's loss by step (each step faint, a 20-step mean over it), its final
    validation loss and `marks` (step: label, e.g. where a curriculum changes split): what a person
    opens first to see whether a run trained."""
    import numpy as np

    fig, ax = pyplot().subplots(figsize=(7, 4.2))
    steps = np.array([r["step"] for r in rows], dtype=float)
    loss = np.array([r["loss"] for r in rows], dtype=float)
    ax.plot(steps, loss, color="tab:blue", alpha=0.3, linewidth=0.8, label="train loss (each step)")
    if len(loss) >= 20:
        ax.plot(steps[19:], np.convolve(loss, np.ones(20) / 20, mode="valid"), color="tab:blue",
                label="train loss (20-step mean)")
    if val_loss is not None and len(steps):
        ax.plot([steps[-1]], [val_loss], "o", color="tab:red", label=f"validation loss {val_loss:.3f}")
    for step, label in (marks or {}).items():
        ax.axvline(step, color="0.4", linestyle="--", linewidth=1, label=label)
    labels(ax, "step", "loss (nats/token)", title)
    return fig
