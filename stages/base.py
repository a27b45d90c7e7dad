"""DVC stage `base`: train a short-context model from scratch (the tiny stand-in for a
pretrained model). With no train.base section it records that pretraining starts from a
pretrained checkpoint instead."""

from __future__ import annotations

if not __package__:  # `python stages/base.py`: stages/ leads sys.path, its tokenize.py shadows Python's
    raise SystemExit("run it as `python -m stages.base` from the project root (or `dvc repro base`)")

from pathlib import Path

from longctx.config import Params
from longctx.io import atomic_dir, write_json
from longctx.train import parallel
from longctx.train.models import base_model

from . import _train
from ._run import METRICS, PLOTS, main

OUT = _train.MODELS / "base"


def run(cfg: Params, root: Path) -> None:
    """Train the base model at its short context window."""
    stage = cfg.train.base
    if stage is None:
        with atomic_dir(OUT) as tmp:
            write_json(tmp / "skipped.json", {"reason": f"train.pretrain.init is {cfg.train.pretrain.init}"})
        METRICS.mkdir(exist_ok=True)
        write_json(METRICS / "base.json", {"skipped": True})
        PLOTS.mkdir(exist_ok=True)  # DVC wants every declared output: a curve with no steps
        (PLOTS / "train_base.csv").write_text(",".join(_train.PLOT_COLUMNS) + "\n")
        print(f"base: skipped (pretrain starts from {cfg.train.pretrain.init})")
        return
    par = parallel.init()
    with _train.tracked(cfg, root, "base", par) as tracker:
        model = base_model(cfg.model, _train.vocab_size(), stage.seed).to(par.device)
        model, summary = _train.fit("base", stage, model, "scratch", tracker, PLOTS / "train_base.csv", par)
        _train.finish("base", model, summary, OUT, par)
    parallel.close()


if __name__ == "__main__":
    main("base", run, trains=lambda cfg: [cfg.train.base] if cfg.train.base else [], writes=(OUT, _train.RUNS))
