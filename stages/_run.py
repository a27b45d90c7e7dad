"""What every stage shares: the project's file layout, argument parsing and error handling."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from longctx import config
from longctx.errors import LongctxError

DATA = Path("data")
CORPORA = DATA / "corpora"
TOKENS = DATA / "tokens"
PACKED = DATA / "packed"
METRICS = Path("metrics")
PLOTS = Path("plots")


def main(name: str, run: Callable[[config.Params, Path], None],
         trains: Callable[[config.Params], list] | None = None) -> None:
    """Parse --params, run the stage from the project root, turn user errors into exit code 2.
    A training stage (`trains` lists its training configs) with train.nproc > 1 checks that they
    fit that many ranks, then starts itself again under torchrun, one process per GPU (gloo
    processes on a CPU machine); rank 0 writes the outputs."""
    parser = argparse.ArgumentParser(prog=f"python -m stages.{name}", description=run.__doc__)
    parser.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    args = parser.parse_args()
    rank0 = os.environ.get("RANK", "0") == "0"
    try:
        cfg = config.load(args.params)
        if trains and "RANK" not in os.environ and (n := _nproc(cfg.train.nproc)) > 1:
            from longctx.train.parallel import check_layout

            for i, stage in enumerate(trains(cfg)):
                check_layout(stage, n, f"train.{name}.{'stages.' + str(i) + '.' if name == 'pretrain' else ''}")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
                   "-m", f"stages.{name}", "--params", args.params]
            print(f"{name}: {n} processes: {' '.join(cmd[1:])}", file=sys.stderr)
            sys.exit(subprocess.run(cmd).returncode)
        run(cfg, Path.cwd())
    except LongctxError as e:  # every rank says it: the launcher may stop the others first
        print(f"{name}: error{'' if rank0 else ' (rank ' + os.environ['RANK'] + ')'}: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        if rank0:
            print(f"{name}: interrupted; no outputs were changed", file=sys.stderr)
        sys.exit(130)


def write_csv(path: Path, rows: list[dict]) -> None:
    """Rows as CSV (DVC plots, MLflow tables); the header is the union of the rows' keys."""
    import csv

    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(dict.fromkeys(k for r in rows for k in r)) or ["empty"])
        writer.writeheader()
        writer.writerows(rows)


def compute_device():
    """The GPU when there is one (single-process stages), else the CPU."""
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _nproc(value: int | str) -> int:
    if value != "auto":
        return int(value)
    import torch

    return max(1, torch.cuda.device_count())
