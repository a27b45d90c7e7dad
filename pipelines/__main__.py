"""The main command: `python -m pipelines [WORKSPACE] [--gpus IDS]` runs the whole pipeline
(corpora to eval) through the Prefect flow, then prints each checkpoint's key scores and how to
open MLflow."""

from __future__ import annotations

import argparse
import configparser
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

# without a Prefect server, the flow starts a temporary one; a loaded 2-core machine needs longer
# than the default 20 s, and telemetry is of no use here
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DVC_NO_ANALYTICS", "1")

# Ctrl-C in the first seconds, while Prefect and the rest import: one line, not a traceback. The
# signal waits for the imports to end (raised inside pydantic's compiled core, it was a Rust panic
# and its backtrace); then the command stops before anything runs.
_interrupted: list[int] = []
signal.signal(signal.SIGINT, lambda signum, frame: _interrupted.append(signum))
from longctx.config import TrackingParams, load  # noqa: E402
from longctx.errors import LongctxError  # noqa: E402
from longctx.eval.summary import summary  # noqa: E402
from longctx.tracking.store import check_store, experiment_id, tracking_uri  # noqa: E402

from .flows import StageFailed, gpu_ids, pipeline, workspace_lock  # noqa: E402
from .server import check_api, prefect_api  # noqa: E402

signal.signal(signal.SIGINT, signal.default_int_handler)
if _interrupted:
    print("longctx pipeline: interrupted while starting; nothing ran", file=sys.stderr)
    sys.exit(130)


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line: the workspace, the GPUs; `--help` says so (a flag is never a path)."""
    parser = argparse.ArgumentParser(prog="python -m pipelines", description=__doc__.split("\n\n")[0])
    parser.add_argument("workspace", nargs="?", default=".", type=Path,
                        help="the project folder with params.yaml and dvc.yaml (default: the current one)")
    parser.add_argument("--gpus", metavar="IDS", help="GPUs the GPU stages share, comma-separated (e.g. 0,1); "
                        "sets LONGCTX_GPUS (default: that variable, else the CPU)")
    args = parser.parse_args(argv)
    if args.gpus is not None and not all(g.strip().isdigit() for g in args.gpus.split(",")):
        parser.error(f"--gpus: {args.gpus!r} is not a comma-separated list of GPU ids such as 0,1")
    return args


def versioned(ws: Path) -> None:
    """A workspace DVC can run in: a git work tree, or DVC set to run without git (core.no_scm);
    said before the run (in a downloaded archive DVC failed the first stage after ~30 s)."""
    try:
        inside = subprocess.run(["git", "-C", str(ws), "rev-parse", "--is-inside-work-tree"], capture_output=True,
                                text=True).returncode == 0
    except FileNotFoundError:
        inside = False
    dvc = configparser.ConfigParser()
    dvc.read(ws / ".dvc" / "config")
    if inside or dvc.getboolean("core", "no_scm", fallback=False):
        return
    raise LongctxError(f"{ws}: not a git repository, which DVC runs in: `git init && git add -A && git commit -m "
                       "start` there, or `dvc config core.no_scm true` to run without git")


def gpus_present() -> None:
    """LONGCTX_GPUS naming GPUs on a machine without CUDA, said before the run: its stages would
    fall back to the CPU, a GPU profile for hours."""
    if not (ids := gpu_ids()):
        return
    import torch  # (only then: the main command imports no torch of its own)

    if not torch.cuda.is_available():
        raise LongctxError(f"LONGCTX_GPUS={','.join(ids)} names GPUs, but this machine has no CUDA device (torch "
                           f"{torch.__version__}): unset it (or drop --gpus) to run on the CPU")


def main() -> None:
    args = arguments()
    if args.gpus is not None:
        os.environ["LONGCTX_GPUS"] = ",".join(g.strip() for g in args.gpus.split(","))
    ws = args.workspace.resolve()
    start = time.perf_counter()
    try:  # bad params, GPUs named where there are none, a store or Prefect API that cannot take the run, or
        # another run here: one line, before Prefect starts
        params = load(ws / "params.yaml")
        versioned(ws)
        gpus_present()
        if params.tracking.enabled:
            check_store(params.tracking, ws)
        check_api()
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
