"""DVC stage `corpora`: raw documents per domain -> data/corpora/<domain>.parquet + manifest."""

from __future__ import annotations

if not __package__:  # `python stages/corpora.py`: stages/ leads sys.path, its tokenize.py shadows Python's
    raise SystemExit("run it as `python -m stages.corpora` from the project root (or `dvc repro corpora`)")

import time
from pathlib import Path

from longctx.config import Params, flat
from longctx.data import corpora
from longctx.data.stats import format_table
from longctx.io import atomic_dir, write_json
from longctx.tracking.runs import stage_run

from ._run import CORPORA, main


def run(cfg: Params, root: Path) -> None:
    """Collect each domain's documents from its sources."""
    with stage_run(cfg.tracking, root, "corpora", flat(cfg.corpora, "corpora")) as tracker:
        t0 = time.perf_counter()
        with atomic_dir(CORPORA) as tmp:
            manifest = corpora.build(cfg.corpora, tmp)
            write_json(tmp / "manifest.json", manifest)  # no timings: a rerun rewrites the same bytes
        seconds = time.perf_counter() - t0
        rows = {d: {"kind": m["kind"], "docs": m["docs"], "MB": round(m["bytes"] / 1e6, 2),
                    "replaced_chars": m["replaced_chars"]} for d, m in manifest["domains"].items()}
        print(format_table(rows, ["kind", "docs", "MB", "replaced_chars"]))
        for d, m in manifest["domains"].items():
            tracker.metrics({f"{d}.{k}": m[k] for k in ("docs", "bytes", "replaced_chars")})
        total = sum(m["bytes"] for m in manifest["domains"].values())
        tracker.metrics({"seconds": seconds, "bytes_per_s": total / max(seconds, 1e-9)})
        tracker.artifact(CORPORA / "manifest.json")


if __name__ == "__main__":
    main("corpora", run, writes=(CORPORA,))
