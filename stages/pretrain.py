"""DVC stage `pretrain`: long-context continued pretraining, one curriculum stage after the
other (ProLong: 64K then 512K), each with its own LR schedule and RoPE setting: a base change,
or LongRoPE factors (documents inside the original window keep the original RoPE)."""

from __future__ import annotations

if not __package__:  # `python stages/pretrain.py`: stages/ leads sys.path, its tokenize.py shadows Python's
    raise SystemExit("run it as `python -m stages.pretrain` from the project root (or `dvc repro pretrain`)")

import contextlib
from pathlib import Path

from longctx.config import Params
from longctx.errors import DataError
from longctx.io import atomic_dir, read_json
from longctx.train import parallel
from longctx.train.models import longrope_factors, with_positions

from . import _train
from ._run import PLOTS, main

OUT = _train.MODELS / "pretrain"


def searched_factors(init: str) -> Path:
    """rope_search's factors, checked to be searched on the model pretraining starts from."""
    path = _train.MODELS / "rope_search" / "factors.json"
    if not path.is_file():
        raise DataError(f"{path}: not found (train.pretrain.factors is 'search': run the rope_search stage)")
    on = read_json(path, "searched RoPE factors").get("searched_on")
    if on != init:
        raise DataError(f"{path}: searched on {on}, but pretraining starts from {init}; rerun rope_search")
    return path


def run(cfg: Params, root: Path) -> None:
    """Continue training at each curriculum stage's length."""
    p = cfg.train.pretrain
    init = str(_train.MODELS / "base") if p.init == "base" else p.init  # a directory or a hub id
    summaries = {}
    par = parallel.init()
    with _train.tracked(cfg, root, "pretrain", par) as tracker, \
            (atomic_dir(OUT) if par.main else contextlib.nullcontext()) as tmp:
        model = _train.load(init, cfg.model.attention_backend).to(par.device)
        origin = f"{init}:{_train.fingerprint(Path(init))}"
        for stage in p.stages:
            window = cfg.pack.splits[stage.split].seq_len
            if p.factors:
                rope = longrope_factors(searched_factors(init) if p.factors == "search" else p.factors, model)
            elif model.cfg.rope is not None:
                theta = stage.rope_theta or model.cfg.rope.theta
                rope = model.cfg.rope.model_copy(update={"theta": theta})
            else:
                rope = None
            model = with_positions(model, rope, max(window, model.cfg.max_position_embeddings))
            # (named split first: MLflow's runs table cuts names at ~12 characters)
            with tracker.nested(f"{stage.split} (pretrain)", {"longctx.curriculum": stage.split}) as stage_tracker:
                model, summary = _train.fit(f"pretrain_{stage.split}", stage, model, origin, stage_tracker,
                                            PLOTS / "pretrain" / f"{stage.split}.csv", par, shown=(tracker,))
            tracker.metrics({f"{stage.split}.{k}": v for k, v in summary.items()})
            # the next stage's run folder depends on these weights (runs name them by params)
            origin = f"{origin}>{stage.model_dump_json()}"
            summaries[stage.split] = summary
            if par.main:
                _train.save(model, tmp / stage.split, summary)
                print(f"pretrain {stage.split}: train loss {summary['train_loss']:.4f}, "
                      f"val loss {summary['val_loss']:.4f}")
    if par.main:
        _train.write_metrics("pretrain", summaries)
    parallel.close()


if __name__ == "__main__":
    main("pretrain", run, trains=lambda cfg: cfg.train.pretrain.stages, writes=(OUT, _train.RUNS))
