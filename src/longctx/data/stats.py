"""Document-length statistics (ProLong Table 14) and the plots people look at."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..plotting import finish, pyplot, save

THRESHOLDS = (4096, 8192, 16384, 32768, 65536)


def length_table(lengths: dict[str, np.ndarray], extra: tuple[int, ...] = ()) -> dict[str, dict]:
    """Per domain: doc count, token percentiles, and % of documents longer than each threshold."""
    thresholds = sorted(set(THRESHOLDS) | set(extra))
    table = {}
    for domain, lens in lengths.items():
        row = {"docs": int(lens.size), "tokens": int(lens.sum())}
        if lens.size:
            row |= {f"p{q}": int(np.percentile(lens, q)) for q in (50, 90, 99)}
            row["max"] = int(lens.max())
        row |= {f"pct_gt_{t // 1024}k": round(100.0 * float((lens > t).mean()), 2) if lens.size else 0.0
                for t in thresholds}
        table[domain] = row
    return table


def format_table(table: dict[str, dict], columns: list[str], key: str = "domain") -> str:
    """A plain-text table: one row per key of `table`, the given columns."""
    head = [key, *columns]
    rows = [[d, *(str(r.get(c, "")) for c in columns)] for d, r in table.items()]
    widths = [max(len(x) for x in col) for col in zip(head, *rows, strict=True)]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    return "\n".join(fmt.format(*r) for r in [head, *rows])


def plot_length_hist(lengths: dict[str, np.ndarray], threshold: int, path: Path) -> None:
    nonempty = {d: v for d, v in lengths.items() if v.size}
    top = max(int(v.max()) for v in nonempty.values())
    bins = np.logspace(0, np.log10(max(top, 10)) + 0.05, 60)
    fig, ax = pyplot().subplots(figsize=(8, 4.5))
    for domain, lens in nonempty.items():
        ax.hist(lens, bins=bins, histtype="step", linewidth=1.4, label=f"{domain} ({lens.size})")
    ax.axvline(threshold, color="k", linestyle="--", linewidth=1, label=f"long threshold {threshold}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    finish(fig, ax, path, "document length (tokens)", "documents",
           "Document lengths per domain (before the length filter)")


def plot_proportions(achieved: dict[str, dict[str, float]], requested: dict[str, dict[str, float]], path: Path) -> None:
    """Requested vs achieved token share per domain, one panel per split."""
    fig, axes = pyplot().subplots(1, len(requested), figsize=(4.5 * len(requested), 4), squeeze=False)
    for ax, (split, req) in zip(axes[0], requested.items(), strict=True):
        names = list(req)
        x = np.arange(len(names))
        ax.bar(x - 0.2, [req[n] for n in names], 0.4, label="requested")
        ax.bar(x + 0.2, [achieved[split].get(n, 0.0) for n in names], 0.4, label="achieved")
        ax.set_xticks(x, names, rotation=45, ha="right", fontsize=8)
        ax.set_title(split)
        ax.set_ylabel("share of tokens")
    axes[0][0].legend()
    save(fig, path)
