"""DVC stage `sft`: supervised fine-tuning on packed conversations, loss on assistant tokens."""

from __future__ import annotations

if not __package__:  # `python stages/sft.py`: stages/ leads sys.path, its tokenize.py shadows Python's
    raise SystemExit("run it as `python -m stages.sft` from the project root (or `dvc repro sft`)")

from pathlib import Path

from longctx.config import Params
from longctx.train import parallel

from . import _train
from ._run import PLOTS, main

OUT = _train.MODELS / "sft"


def run(cfg: Params, root: Path) -> None:
    """Fine-tune the last pretraining stage's model on instructions."""
    init = _train.MODELS / "pretrain" / cfg.train.pretrain.stages[-1].split
    par = parallel.init()
    with _train.tracked(cfg, root, "sft", par) as tracker:
        model = _train.load(init, cfg.model.attention_backend).to(par.device)
        model, summary = _train.fit("sft", cfg.train.sft, model, f"{init}:{_train.fingerprint(init)}", tracker,
                                    PLOTS / "train_sft.csv", par)
        _train.finish("sft", model, summary, OUT, par)
    parallel.close()


if __name__ == "__main__":
    main("sft", run, trains=lambda cfg: [cfg.train.sft], writes=(OUT, _train.RUNS))
