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
