"""What every stage shares: the project's file layout, argument parsing and error handling."""

from __future__ import annotations

import argparse
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


def main(name: str, run: Callable[[config.Config, Path], None]) -> None:
    """Parse --params, run the stage from the project root, turn user errors into exit code 2."""
    parser = argparse.ArgumentParser(prog=f"python -m stages.{name}", description=run.__doc__)
    parser.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    args = parser.parse_args()
    try:
        cfg = config.load(args.params)
        run(cfg, Path.cwd())
    except LongctxError as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print(f"{name}: interrupted; no outputs were changed", file=sys.stderr)
        sys.exit(130)
