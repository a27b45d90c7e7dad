"""DVC stage `sft`: supervised fine-tuning on packed conversations, loss on assistant tokens."""

from __future__ import annotations

from pathlib import Path

from longctx.config import Config
from longctx.tracking import stage_run
from longctx.train.models import load_model

from . import _train
from ._run import PLOTS, main

OUT = _train.MODELS / "sft"


def run(cfg: Config, root: Path) -> None:
    """Fine-tune the last pretraining stage's model on instructions."""
    init = _train.MODELS / "pretrain" / cfg.train.pretrain.stages[-1].split
    with stage_run(cfg.tracking, root, "sft", _train.params(cfg, "sft")) as tracker:
        model = load_model(init, cfg.model.attention_backend)
        summary = _train.fit("sft", cfg.train.sft, model, f"{init}:{_train.fingerprint(init)}", tracker,
                             PLOTS / "train_sft.csv")
        _train.finish("sft", model, summary, OUT)


if __name__ == "__main__":
    main("sft", run)
