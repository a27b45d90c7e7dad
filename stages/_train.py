"""What the base, pretrain and SFT stages share: data, run folders that resume, outputs."""

from __future__ import annotations

import contextlib
import csv
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from longctx.config import Params, RunParams, StageParams, flat
from longctx.data.loader import PackedDataset, training_data
from longctx.errors import DataError
from longctx.io import atomic_dir, check_room, clear_stale, read_json, write_json
from longctx.model.transformer import Transformer
from longctx.plotting import loss_curve
from longctx.tracking.runs import stage_run
from longctx.tracking.tracker import Tracker
from longctx.train.loop import mean_loss, train
from longctx.train.models import load_model, save_model
from longctx.train.parallel import Parallel, unshard, with_sequence_parallel

from ._run import METRICS, PACKED, TOKENS, tokenizer

MODELS = Path("models")
PLOT_COLUMNS = ["step", "loss", "lr", "grad_norm", "tokens_per_s"]
"""A training stage's loss curve (plots/train_<stage>.csv, a DVC plot)."""
RUNS = Path("runs")  # checkpoints of unfinished runs: scratch, not a DVC output


def vocab_size() -> int:
    return int(read_json(TOKENS / "index.json", "token index")["vocab_size"])


def load(init: str | Path, attention_backend: str) -> Transformer:
    """A checkpoint to train or score on this project's tokens. One saved by a stage records its
    tokenizer, which must be the one data/tokens was made with; any checkpoint's vocabulary must
    hold every token id."""
    index = read_json(TOKENS / "index.json", "token index")
    summary = Path(init) / "summary.json"
    made = read_json(summary, "model summary").get("tokenizer") if summary.is_file() else None
    if made is not None and made != index["fingerprint"]:
        raise DataError(f"{init}: trained on tokens of tokenizer {made}, but {TOKENS} was made with tokenizer "
                        f"{index['fingerprint']}: the tokenizer does not match the checkpoint (rerun from base)")
    model = load_model(init, attention_backend)
    if int(index["vocab_size"]) > model.cfg.vocab_size:
        raise DataError(f"{init}: its vocabulary has {model.cfg.vocab_size} tokens, {TOKENS} has ids up to "
                        f"{index['vocab_size']}: the tokenizer does not match the checkpoint")
    return model


def fingerprint(folder: Path) -> str:
    """Identifies a saved model cheaply (names, sizes, modification times of its files)."""
    h = hashlib.sha256()
    for f in sorted(folder.rglob("*")) if folder.is_dir() else []:
        if f.is_file():
            st = f.stat()
            h.update(f"{f.relative_to(folder)}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def run_folder(name: str, stage: StageParams, model: Transformer, init: str) -> Path:
    """A run resumes only into the folder of the same params, model, starting weights and data."""
    data = [fingerprint(PACKED / split / "train") for split in [*(p.split for p in stage.curriculum), stage.split]]
    recipe = stage.model_dump(mode="json", exclude=set(stage.PLACEMENT))
    key = json.dumps([recipe, model.cfg.model_dump(mode="json"), init, data], sort_keys=True)
    return RUNS / name / hashlib.sha256(key.encode()).hexdigest()[:12]


@contextlib.contextmanager
def tracked(cfg: Params, root: Path, name: str, par: Parallel) -> Iterator[Tracker]:
    """The stage's MLflow run on the main rank; a tracker that records nothing on the others. The
    tokenizer is checked first: the model's summary and export will name it."""
    tokenizer()
    if not par.main:
        yield Tracker()
        return
    clear_stale(MODELS, name)  # what a killed run of this stage left beside its output
    with stage_run(cfg.tracking, root, name, params(cfg, name), section="train") as tracker:
        yield tracker


def fit(name: str, stage: StageParams, model: Transformer, init: str, tracker, plot: Path,
        par: Parallel, shown: tuple[Tracker, ...] = ()) -> tuple[Transformer, dict]:
    """Train one stage (resuming if a run of it was interrupted) on every rank; write its loss
    curve to `plot` (CSV, a DVC plot) and its figure `train_<stage>.png` (a curriculum stage's by
    its split: `train_stage1.png`) to its run and the `shown` runs; return the trained model,
    whole on every rank, and its summary."""
    train_data, val_data = training_data(PACKED, stage), PackedDataset(PACKED / stage.split / "val")
    folder = run_folder(name, stage, model, init)
    if par.main:
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        check_room(RUNS, 3 * weights * (stage.keep_last + 1), f"{name}'s checkpoints (weights, AdamW's moments)")
        check_room(MODELS, 2 * weights, f"the {name} model (ours and the HF export)")
    tracker.text(str(folder), f"{name}_run_folder.txt")
    par = with_sequence_parallel(par, stage.sequence_parallel, model.cfg.n_heads)
    loop_cfg = RunParams(**{k: v for k, v in stage.model_dump().items() if k in RunParams.model_fields})
    last = train(model, train_data, loop_cfg, folder, tracker, par=par)
    val = mean_loss(model, val_data, stage.val_sequences, stage.loss_chunk, par)
    model = unshard(model, par)
    par.barrier()  # the main rank's metrics.jsonl is complete
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    summary = {"train_loss": last["loss"], "val_loss": val, "steps": stage.steps,
               "tokens_per_s": sum(r["tokens_per_s"] for r in rows[-10:]) / len(rows[-10:])}
    if par.main:
        plot.parent.mkdir(parents=True, exist_ok=True)
        with plot.open("w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=PLOT_COLUMNS, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
        tracker.metrics({f"final.{k}": v for k, v in summary.items()})
        tracker.artifact(plot)
        ends = np.cumsum([p.steps for p in stage.curriculum])  # where each phase hands over to the next
        marks = {int(end): f"then {split}"
                 for end, split in zip(ends, [p.split for p in stage.curriculum[1:]] + [stage.split], strict=False)}
        for run in (tracker, *shown):
            run.figure(lambda: loss_curve(rows, f"{name}: training loss", val, marks),
                       f"train_{name.removeprefix('pretrain_')}.png")
    return model, summary


TIMINGS = ("tokens_per_s",)
"""Summary keys that are measurements of speed: in metrics and MLflow, never in a model folder
(a DVC output: a rerun that resumes a finished run must write the same bytes)."""


def save(model: Transformer, folder: Path, summary: dict) -> None:
    """The model (ours + HF export, with the tokenizer) and its training summary (no timings;
    the tokenizer's fingerprint, checked by `load`)."""
    _, index = tokenizer()  # (again: the folder may have been replaced while the stage trained)
    save_model(model, folder, TOKENS / "tokenizer")
    write_json(folder / "summary.json", {k: v for k, v in summary.items() if k not in TIMINGS}
               | {"tokenizer": index["fingerprint"]})


def write_metrics(name: str, summary: dict) -> None:
    METRICS.mkdir(exist_ok=True)
    write_json(METRICS / f"{name}.json", summary)


def finish(name: str, model: Transformer, summary: dict, out: Path, par: Parallel) -> None:
    """Save a single-model stage's output atomically (main rank), its metrics, and say how it went."""
    if not par.main:
        return
    with atomic_dir(out) as tmp:
        save(model, tmp, summary)
    write_metrics(name, summary)
    print(f"{name}: train loss {summary['train_loss']:.4f}, val loss {summary['val_loss']:.4f}")


def params(cfg: Params, section: str) -> dict:
    return flat(cfg.model, "model") | flat(getattr(cfg.train, section), f"train.{section}")
