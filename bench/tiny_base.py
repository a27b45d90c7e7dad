"""Make checkpoints/tiny-base, the pretrained short-context model the tiny profile starts from (as
the real profiles start from Llama-3-8B): the tiny-scratch profile's corpora, tokenize, pack and
base stages in a scratch folder, then the base model, its tokenizer and provenance.json (what made
it, with the recipe's params, which tests/test_tiny_base.py holds equal to tiny-scratch's) copied
into place. ~16 minutes on 2 cores (2,500 base steps).

    python bench/tiny_base.py                                # replaces checkpoints/tiny-base
    python bench/tiny_base.py --params my.yaml --out /tmp/b  # other overrides, elsewhere
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

from longctx import config
from longctx.errors import ConfigError
from longctx.io import atomic_dir, read_json, write_json

REPO = Path(__file__).resolve().parents[1]
STAGES = ("corpora", "tokenize", "pack", "base")
MODEL_FILES = ("longctx_config.json", "model.safetensors", "summary.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def recipe(cfg: config.Params) -> dict:
    """The params that decide the base model: the corpora (all of them train the BPE), the
    tokenizer, the base split's packing, the model's shape and its training."""
    if cfg.train.base is None:
        raise ConfigError(f"profile {cfg.profile}: train.base is not set; nothing trains a base model")
    d = cfg.model_dump(mode="json", exclude={"train": {"base": set(cfg.train.base.PLACEMENT)}})
    split = cfg.train.base.split
    pack = {k: v for k, v in d["pack"].items() if k != "splits"} | {"splits": {split: d["pack"]["splits"][split]}}
    return {"corpora": d["corpora"], "tokenize": d["tokenize"], "pack": pack, "model": d["model"],
            "train.base": d["train"]["base"]}


def _commit() -> str | None:
    proc = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True, text=True)
    return proc.stdout.strip() or None


def make(overrides: dict, out: Path, work: Path) -> dict:
    """Run the stages that make a base model in `work` and put it, its tokenizer and its
    provenance in `out` (replaced whole, only on success). Returns the provenance."""
    cfg = config.resolve(overrides)
    made_of = recipe(cfg)
    work.mkdir(parents=True, exist_ok=True)
    (work / "params.yaml").write_text(yaml.safe_dump({**overrides, "tracking": {"enabled": False}}, sort_keys=False))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"), str(REPO),
                                                                       os.environ.get("PYTHONPATH")]))}
    seconds = {}
    for stage in STAGES:
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", f"stages.{stage}"], cwd=work, env=env)
        if proc.returncode != 0:
            raise SystemExit(f"tiny_base: stage {stage} failed (exit {proc.returncode}) in {work}; {out} unchanged")
        seconds[stage] = round(time.perf_counter() - start, 1)
    model, tokenizer = work / "models" / "base", work / "data" / "tokens" / "tokenizer"
    summary = read_json(model / "summary.json", "model summary")
    provenance = {
        "made_by": "python bench/tiny_base.py", "date": datetime.date.today().isoformat(), "git_commit": _commit(),
        "python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
        "stage_seconds": seconds, "train_loss": summary["train_loss"], "val_loss": summary["val_loss"],
        "tokenizer": summary["tokenizer"], "recipe": made_of,
    }
    with atomic_dir(out) as tmp:
        for name in MODEL_FILES:
            shutil.copy2(model / name, tmp / name)
        for name in TOKENIZER_FILES:
            shutil.copy2(tokenizer / name, tmp / name)
        write_json(tmp / "provenance.json", provenance)
    return provenance


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=Path, help="YAML overrides (default: profile tiny-scratch as it is)")
    ap.add_argument("--out", type=Path, default=REPO / "checkpoints" / "tiny-base")
    ap.add_argument("--work", type=Path, help="scratch folder for the stages (default: a temporary one)")
    args = ap.parse_args(argv)
    try:
        overrides = yaml.safe_load(args.params.read_text()) if args.params else {"profile": "tiny-scratch"}
    except (OSError, yaml.YAMLError) as e:
        raise SystemExit(f"tiny_base: --params {args.params}: {e}") from None
    if not isinstance(overrides, dict):
        raise SystemExit(f"tiny_base: --params {args.params}: must be a mapping of sections")
    try:
        if args.work is not None:
            p = make(overrides, args.out, args.work)
        else:
            with tempfile.TemporaryDirectory(prefix="tiny-base-") as work:
                p = make(overrides, args.out, Path(work))
    except ConfigError as e:
        raise SystemExit(f"tiny_base: {e}") from None
    print(f"{args.out}: train loss {p['train_loss']:.4f}, val loss {p['val_loss']:.4f}, "
          f"stages {p['stage_seconds']} s")


if __name__ == "__main__":
    main()
