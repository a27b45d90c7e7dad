"""The main command: `python -m pipelines [WORKSPACE]` runs the whole pipeline (corpora to eval)
through the Prefect flow, then prints each checkpoint's key scores and how to open MLflow."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from longctx.eval.report import BEYOND, beyond, length_means

# without a Prefect server, the flow starts a temporary one; a loaded 2-core machine needs longer
# than the default 20 s, and telemetry is of no use here
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DVC_NO_ANALYTICS", "1")

from .flows import pipeline  # noqa: E402


def summary(ws: Path) -> str:
    """Each checkpoint's score on every task at every evaluated length, its perplexities, and a
    line naming the best checkpoint at the longest length."""
    ev = json.loads((ws / "metrics" / "eval.json").read_text())
    lengths, means = length_means(ev["tasks"])
    windows = ev.get("windows", {})  # (absent from results of older runs)
    tasks = sorted({t for by_task in ev["tasks"].values() for t in by_task})
    head = ["checkpoint", *[f"{t}@{n}" for n in lengths for t in tasks], "ppl@longest", "needle ppl@longest",
            "short ppl"]
    rows = [head]
    for ckpt, by_task in ev["tasks"].items():
        cells = [ckpt, *(f"{by_task[t][str(n)]:.2f}{BEYOND if beyond(windows, ckpt, n) else ''}"
                         if str(n) in by_task.get(t, {}) else "-" for n in lengths for t in tasks)]
        ppl, needle = ev["ppl_by_length"].get(ckpt, {}), ev["needle_ppl"].get(ckpt, {})
        top = max(ppl, key=int) if ppl else None
        cells += [f"{ppl[top]:.1f}" if top else "n/a", f"{needle[top]:.1f}" if top in needle else "n/a",
                  f"{ev['retention_ppl'][ckpt]:.1f}" if ckpt in ev["retention_ppl"] else "n/a"]
        rows.append(cells)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    table = "\n".join("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
                      for r in rows)
    if any(beyond(windows, c, n) for c in ev["tasks"] for n in lengths):
        table += f"\n{BEYOND} beyond the checkpoint's window (the length it was trained to)"
    longest = lengths[-1] if lengths else None
    scored = {c: by[longest] for c, by in means.items() if longest in by}
    if not scored:
        return table
    best = max(scored.values())
    leaders = [c for c, v in scored.items() if v == best]
    if len(leaders) == len(scored):
        return table + f"\nat {longest} tokens every checkpoint scores {best:.2f}: the tasks do not tell them apart"
    return table + f"\nbest at {longest} tokens: {', '.join(leaders)} (mean task score {best:.2f})"


def main() -> None:
    ws = Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()
    start = time.perf_counter()
    pipeline(str(ws))
    print(f"\nlongctx pipeline finished in {time.perf_counter() - start:.0f} s\n")
    print(summary(ws))
    print("\nppl@longest: the longest length with validation documents (all of it in metrics/eval.json)")
    print(f"open the runs:  mlflow ui --backend-store-uri sqlite:///{ws / 'mlflow.db'}")


if __name__ == "__main__":
    main()
