"""The main command: `python -m pipelines [WORKSPACE]` runs the whole pipeline (corpora to eval)
through the Prefect flow, then prints each checkpoint's key scores and how to open MLflow."""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from pathlib import Path

from longctx.config import TrackingParams, load
from longctx.errors import LongctxError
from longctx.eval.report import BEYOND, beyond, length_means
from longctx.tracking import experiment_id, tracking_uri

# without a Prefect server, the flow starts a temporary one; a loaded 2-core machine needs longer
# than the default 20 s, and telemetry is of no use here
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DVC_NO_ANALYTICS", "1")

from .flows import StageFailed, pipeline, workspace_lock  # noqa: E402
from .server import prefect_api  # noqa: E402


def summary(ws: Path) -> str:
    """One column per checkpoint: its score on every task at every evaluated length (a block per
    length, with the mean), its perplexities, and a line naming the best checkpoint at the
    longest length."""
    ev = json.loads((ws / "metrics" / "eval.json").read_text())
    lengths, means = length_means(ev["tasks"])
    windows = ev.get("windows", {})  # (absent from results of older runs)
    ckpts = list(ev["tasks"])
    tasks = sorted({t for by_task in ev["tasks"].values() for t in by_task})

    cells = ev.get("cells", {})  # (absent from results of older runs)

    def score(ckpt: str, value: float | None, n: int, task: str | None = None) -> str:
        if value is None:
            return "-"
        cell = cells.get(ckpt, {}).get(task, {}).get(str(n)) if task else None
        text = f"{value:.2f} [{cell['lo']:.2f}-{cell['hi']:.2f}]" if cell else f"{value:.2f}"
        return text + (BEYOND if beyond(windows, ckpt, n) else "")

    def counts(n: int) -> str:
        seen = sorted({cell[str(n)]["n"] for by in cells.values() for cell in by.values() if str(n) in cell})
        return f" (n = {'/'.join(map(str, seen))} prompts a task; 95% intervals)" if seen else ""

    rows = [["", *ckpts]]
    for n in lengths:
        rows.append([f"at {n} tokens{counts(n)}"])
        rows += [[f"  {t}", *(score(c, ev["tasks"][c].get(t, {}).get(str(n)), n, t) for c in ckpts)] for t in tasks]
        rows.append(["  mean", *(score(c, means[c].get(n), n) for c in ckpts)])
        verdicts = ev.get("verdicts", {})
        if verdicts:
            rows.append(["  vs base", *(verdict(verdicts[c]["base"]["all"].get(str(n))) if c in verdicts else ""
                                        for c in ckpts)])

    def ppl(table: dict, ckpt: str) -> str:
        by = table.get(ckpt, {})
        top = max(ev["ppl_by_length"].get(ckpt, {}), key=int, default=None)
        return f"{by[top]:.1f}" if top in by else "n/a"

    tops = {max(by, key=int) for by in ev["ppl_by_length"].values() if by}
    at = f"{tops.pop()} tokens" if len(tops) == 1 else "the longest length"
    rows += [["perplexity"], [f"  at {at}", *(ppl(ev["ppl_by_length"], c) for c in ckpts)],
             [f"  needle at {at}", *(ppl(ev["needle_ppl"], c) for c in ckpts)],
             ["  short context", *(f"{ev['retention_ppl'][c]:.1f}" if c in ev["retention_ppl"] else "n/a"
                                   for c in ckpts)]]
    width = [max(len(r[i]) for r in rows if len(r) > i) for i in range(len(ckpts) + 1)]
    table = "\n".join("  ".join([r[0].ljust(width[0]), *(c.rjust(w) for c, w in zip(r[1:], width[1:], strict=False))])
                       .rstrip() for r in rows)  # (a block's heading row has one cell)
    if any(beyond(windows, c, n) for c in ev["tasks"] for n in lengths):
        table += f"\n{BEYOND} beyond the checkpoint's window (the length it was trained to)"
    longest = lengths[-1] if lengths else None
    top = ev.get("best", {}).get(str(longest))
    if top is None:
        return table
    if all(v["wins"] == v["losses"] == 0 for v in top["against"].values()):
        return table + (f"\nat {longest} tokens every checkpoint scores {top['mean']:.2f}, alike on every prompt: "
                        "the tasks do not tell them apart")
    if top["supported"]:
        return table + (f"\nbest at {longest} tokens: {top['checkpoint']} (mean over its prompts {top['mean']:.2f}; "
                        "better than every other checkpoint on the same prompts at 95%)")
    ties = [c for c, v in top["against"].items() if v["verdict"] != "better"]
    return table + (f"\nat {longest} tokens no checkpoint is best at 95%: {top['checkpoint']} scores highest "
                    f"({top['mean']:.2f} over its prompts) but is not better than {', '.join(ties)} on the same "
                    "prompts")


def verdict(v: dict | None) -> str:
    """A paired verdict in a table cell: `better 12-3` (prompts won and lost)."""
    if v is None:
        return "-"
    return f"{'no diff.' if v['verdict'] == 'no difference' else v['verdict']} {v['wins']}-{v['losses']}"


def main() -> None:
    ws = Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()
    start = time.perf_counter()
    try:  # bad params, or another run in this workspace: one line, before Prefect starts
        params = load(ws / "params.yaml")
        with workspace_lock(ws):
            pass
    except LongctxError as e:
        print(f"longctx pipeline: {e}", file=sys.stderr)
        sys.exit(2)
    try:
        with prefect_api():
            pipeline(str(ws))
    except StageFailed as e:  # the stage's own error and how to rerun; Prefect's log has the rest
        print(f"\nlongctx pipeline: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:  # Ctrl-C: the stage said what it kept; the flow run is recorded as crashed
        print("\nlongctx pipeline: interrupted; finished stages are kept and a training stage resumes from its "
              "last checkpoint: rerun the same command to go on", file=sys.stderr)
        sys.exit(130)
    print(f"\nlongctx pipeline finished in {time.perf_counter() - start:.0f} s\n")
    print(summary(ws))
    print("\nperplexity at the longest length with validation documents; every length in metrics/eval.json")
    print("\n".join(open_runs(ws, params.tracking)))


UI = "http://127.0.0.1:5000"
"""Where `mlflow ui` serves by default."""


def open_runs(ws: Path, tracking: TrackingParams) -> list[str]:
    """How to see the runs: the command that serves a local store, and the address of the
    experiment's runs table. MLflow 3.17's UI opens an experiment on its GenAI overview unless the
    address (or the browser's saved choice) says `workflowType=machine_learning`: it reads no tag or
    server setting for it (its `mlflow.experimentKind` is consulted only where the toggle is off)."""
    if not tracking.enabled:
        return ["MLflow tracking is off (params tracking.enabled)"]
    uri = tracking_uri(tracking, ws)
    page = runs_page(experiment_id(tracking, ws))
    if uri.startswith(("http://", "https://")):
        return [f"open the runs:  {uri.rstrip('/')}/{page}"]
    return [f"open the runs:  {mlflow_ui(uri)}", f"          then:  {UI}/{page}"]


def mlflow_ui(uri: str) -> str:
    """The command that serves a store, quoted to paste (a path may hold spaces)."""
    return f"mlflow ui --backend-store-uri {shlex.quote(uri)}"


def runs_page(experiment: str) -> str:
    """The UI's address (after the server's) of an experiment's runs table, in the model-training view."""
    return f"#/experiments/{experiment}/runs?workflowType=machine_learning"


if __name__ == "__main__":
    main()
