"""DVC stage `eval`: every checkpoint the pipeline made (base, each pretrain stage, sft), the same
prompts for all: RULER/HELMET-style tasks by greedy decoding, per-position loss, perplexity
against context length, needle perplexity, and short-context retention."""

from __future__ import annotations

if not __package__:  # `python stages/eval.py`: stages/ leads sys.path, its tokenize.py shadows Python's
    raise SystemExit("run it as `python -m stages.eval` from the project root (or `dvc repro eval`)")

import hashlib
import json
import shutil
import time
from pathlib import Path

from longctx.config import Params, flat
from longctx.data.loader import PackedDataset
from longctx.errors import ConfigError, DataError
from longctx.eval import needle, report, suite, tasks
from longctx.eval.plots import family_figure
from longctx.io import atomic_dir, read_json, write_json
from longctx.tracking.runs import stage_run

from . import STARTED, _train
from ._run import METRICS, PACKED, PLOTS, TOKENS, compute_device, main, tokenizer, write_csv

OUT = Path("reports") / "eval"
PLOT_DIR = PLOTS / "eval"
PARTIAL = _train.RUNS / "eval"
"""Each checkpoint's measurements as soon as it is scored, so an eval cut short (a call's or a
job's time limit, SIGTERM, Ctrl-C) goes on with the checkpoints it had not scored; removed when
the stage finishes. Scratch, not an output: DVC removes a stage's outputs before it reruns."""
HEADLINE = Path("metrics.json")
"""dvc.yaml's one metrics file, the columns `dvc exp show` puts first: each checkpoint's mean task
score at each length and its validation loss (metrics/eval.json, an output, holds the rest: with
every stage's metrics/<stage>.json the tiny run's table had 872 columns)."""


def checkpoints(cfg: Params) -> dict[str, Path]:
    """Name -> folder of every checkpoint the pipeline made, in training order; "base" is the one
    pretraining started from: the base stage's, or pretrain.init when that is a checkpoint of this
    project's (the tiny profile's committed base; a hub model is not scored here)."""
    out = {}
    init = Path(cfg.train.pretrain.init)
    if cfg.train.base is not None:
        out["base"] = _train.MODELS / "base"
    elif (init / "longctx_config.json").is_file():
        out["base"] = init
    for stage in cfg.train.pretrain.stages:
        out[f"pretrain_{stage.split}"] = _train.MODELS / "pretrain" / stage.split
    out["sft"] = _train.MODELS / "sft"
    for name, folder in out.items():
        if not (folder / "longctx_config.json").is_file():
            raise DataError(f"{folder}: checkpoint {name!r} is missing (run the stage that makes it)")
    return out


def long_split(cfg: Params) -> PackedDataset:
    """The validation part of the split with the longest sequences (long documents)."""
    name = max(cfg.pack.splits, key=lambda s: cfg.pack.splits[s].seq_len)
    return PackedDataset(PACKED / name / "val")


def retention_split(cfg: Params) -> PackedDataset | None:
    name = cfg.eval.retention_split or (cfg.train.base.split if cfg.train.base else None)
    return PackedDataset(PACKED / name / "val") if name else None


class Clock:
    """Seconds of each phase since the last, for the lines that say where the stage's time went."""

    def __init__(self, since: float):
        self.last, self.laps = since, {}

    def lap(self, name: str) -> float:
        now = time.perf_counter()
        self.laps[name] = self.laps.get(name, 0.0) + now - self.last
        self.last = now
        return self.laps[name]

    def line(self) -> str:
        return f"{sum(self.laps.values()):.1f} s (" + ", ".join(f"{k} {v:.1f}" for k, v in self.laps.items()) + ")"


def run_key(cfg: Params, device) -> str:
    """What every checkpoint's measurements depend on: every param (tracking's aside), the tokens
    and packed data, the device, and the code that scores (its text: a checkout changes every
    file's time). Read once a stage; `scored_key` adds each checkpoint's weights."""
    code = hashlib.sha256()
    for f in sorted([*Path("src/longctx").rglob("*.py"), *Path("stages").glob("*.py")]):
        code.update(f"{f}:".encode() + f.read_bytes())
    params = cfg.model_dump(mode="json", exclude={"tracking"})
    return hashlib.sha256(json.dumps([params, _train.fingerprint(TOKENS), _train.fingerprint(PACKED), str(device),
                                      code.hexdigest()], sort_keys=True).encode()).hexdigest()


def scored_key(run: str, name: str, folder: Path) -> str:
    """One checkpoint's key: the run's (`run_key`), its name and its weights' files."""
    return hashlib.sha256(f"{run}:{name}:{_train.fingerprint(folder)}".encode()).hexdigest()[:16]


def scored_before(name: str, key: str) -> tuple[dict, list[dict], list[dict]] | None:
    """(results, prompt rows, position rows) of `name` kept by a run cut short with the same key."""
    try:
        kept = json.loads((PARTIAL / f"{name}.json").read_text())
    except (OSError, ValueError):  # none, or one a kill cut mid-write
        return None
    if kept.get("key") != key:
        return None
    return report.int_keys(kept["results"]), kept["rows"], kept["curve"]


def run(cfg: Params, root: Path) -> None:
    """Evaluate every checkpoint with the same prompts."""
    clock = Clock(STARTED)
    clock.lap("imports")
    ec = cfg.eval
    ckpts = checkpoints(cfg)
    if unknown := sorted(set(ec.samples_by_checkpoint) - set(ckpts)):
        raise ConfigError(f"eval.samples_by_checkpoint: {unknown} name no checkpoint this run evaluates "
                          f"(it evaluates {list(ckpts)})")
    tok, _ = tokenizer()
    windows = suite.windows(ckpts, tok, TOKENS / "tokenizer", ec.lengths)
    data = long_split(cfg)
    found = needle.long_documents(data, 1)
    if not found:
        raise DataError(f"{data.folder}: no document of a long domain to hide needles in (niah_single_text's "
                        "haystack, perplexity against length): give this split long data")
    first = data[found[0]]
    haystack = tok.tok.decode(first.input_ids[:first.doc_lens[0]].tolist())  # real text: one long document
    clock.lap("data")  # the tokenizer, each checkpoint's window, the haystack
    device = compute_device()
    results = report.empty_results()
    rows_all, position_rows = [], []
    if "sft" in ckpts and not tok.chat_template:
        raise DataError(f"{TOKENS / 'tokenizer'}: no chat template to evaluate the SFT checkpoint with")
    encoders = (suite.Encoder(tok, False),) + ((suite.Encoder(tok, True),) if tok.chat_template else ())
    with stage_run(cfg.tracking, root, "eval", flat(ec, "eval")) as tracker, \
            suite.PromptBank(encoders, ec, haystack) as bank:  # the prompts, made while checkpoints score
        short = retention_split(cfg)
        clock.lap("MLflow run")
        ready, shared = False, run_key(cfg, device)
        for name, folder in ckpts.items():
            key = scored_key(shared, name, folder)
            kept = scored_before(name, key)
            if kept is None:
                model = suite.inference_weights(_train.load(folder, cfg.model.attention_backend).to(device).eval())
                suite.pruned(model, ec.acp_eps, name)
                loaded = clock.lap(f"{name} loaded" if ready else "first checkpoint loaded")
                if not ready:
                    print(f"eval: ready in {clock.line()}", flush=True)
                    ready = True
                scored = report.empty_results()
                rows, curve = suite.evaluate(scored, name, model, folder, suite.Encoder(tok, name == "sft"), ec, data,
                                             windows[name], short, bank)
                PARTIAL.mkdir(parents=True, exist_ok=True)
                write_json(PARTIAL / f"{name}.json", {"key": key, "results": scored, "rows": rows, "curve": curve},
                           sort_keys=False)  # (the rows keep their columns' order)
            else:
                scored, rows, curve = kept
            report.merge_checkpoint(results, scored)
            rows_all += rows
            position_rows += curve
            means = results["means"][name]  # as it comes: a run cut short keeps it
            scores = ", ".join(f"{m['mean']:.2f} [{m['lo']:.2f}-{m['hi']:.2f}] at {n} (n = {m['n']})"
                               for n, m in means.items())
            print(f"eval {name}: mean task score {scores}", flush=True)
            speed = results["throughput"][name]
            if kept is not None:
                print(f"eval {name}: scored by an earlier run of the same checkpoint, params and code that was cut "
                      f"short, kept ({PARTIAL / name}.json)", flush=True)
            else:
                spent = clock.lap(f"{name} scored")
                acp = (f", ACP skipped {speed['acp_pruned']:.0%} of the prefill's tiles" if "acp_pruned" in speed
                       else "")
                print(f"eval {name}: {spent:.1f} s ({speed['seconds']:.1f} the tasks at {speed['prompts_per_s']:.1f} "
                      f"prompts/s{acp}, {spent - speed['seconds']:.1f} perplexities and the rest; {loaded:.1f} its "
                      "load)", flush=True)
            tracker.metrics({f"{name}.{t}.{n}": v for t, by in results["tasks"][name].items() for n, v in by.items()})
            tracker.metrics({f"{name}.{t}.{n}.{k}": cell[k] for t, by in results["cells"][name].items()
                             for n, cell in by.items() for k in ("n", "lo", "hi")})
            tracker.metrics({f"{name}.mean.{n}.{k}": m[k] for n, m in means.items() for k in ("mean", "n", "lo", "hi")})
            tracker.metrics({f"{name}.{k}": speed[k] for k in ("prompts_per_s", "tokens_per_s", "acp_pruned")
                             if k in speed})
            if windows[name].length is not None:  # scores at lengths above it were measured beyond the window
                tracker.metrics({f"{name}.window": windows[name].length})
        results["verdicts"] = report.verdicts(rows_all, list(ckpts))
        results["best"] = report.best(rows_all, list(ckpts))
        results["formats"] = report.format_groups(rows_all, list(ckpts), tasks.trained_formats(cfg))
        results["near_misses"] = report.near_misses(rows_all)
        sign = {"better": 1, "worse": -1, "no difference": 0}
        tracker.metrics({f"{c}.vs_{against}.{t}.{n}": sign[v["verdict"]] for c, by in results["verdicts"].items()
                         for against, cmp in by.items() for t, at in cmp.items() if t != "vs" for n, v in at.items()})
        write_outputs(results, rows_all, position_rows)
        write_json(HEADLINE, headline(results, ckpts), sort_keys=False)
        groups = results["formats"]
        tracker.metrics({f"{c}.{g}.{n}.{k}": cell[k] for g in groups["tasks"] if groups["tasks"][g]
                         for c, by in groups["means"][g].items() for n, cell in by.items()
                         for k in ("mean", "n", "lo", "hi")})
        tracker.metrics({f"{c}.loss_at_{band}": v for c, by in results["position_loss"].items()
                         for band, v in by.get("bands", {}).items()})
        for f in ("position_loss.png", "position_loss.csv", "score_vs_length.png", "scores.csv", "niah_heatmap.png"):
            tracker.artifact(PLOT_DIR / f)
        tracker.figure(lambda: family_figure(results["tasks"], results["windows"]), "score_by_family.png")
        tracker.artifact(OUT / "comparison.md")
        tracker.artifact(OUT / "prompts.jsonl")  # every answer beside its gold: what a score of 0 wrote
        tracker.metrics({f"{c}.retention_ppl": v for c, v in results["retention_ppl"].items()})
        tracker.metrics({f"{c}.needle_answers.{n}.{k}": cell[k] for c, by in results["near_misses"].items()
                         for n, cell in by.items() for k in ("wrong", "near")})
        shutil.rmtree(PARTIAL, ignore_errors=True)  # (every output written)
        clock.lap("outputs and figures")
    clock.lap("MLflow run end")
    print((OUT / "comparison.md").read_text())
    print(f"eval: {clock.line()}", flush=True)


def headline(results: dict, ckpts: dict[str, Path]) -> dict:
    """`<checkpoint>@<length>`: its mean task score there (the MLflow parent run's
    `results/<checkpoint>.tasks_at_<length>`), in training order and by length; then `val_loss`:
    each trained checkpoint's last validation loss (its summary's). Short names: `dvc exp show`
    cuts a column wider than its share of the terminal to "…"."""
    _, means = report.length_means(results["tasks"])
    out: dict = {f"{name}@{n}": v for name in ckpts for n, v in sorted(means.get(name, {}).items())}
    out["val_loss"] = {}
    for name, folder in ckpts.items():
        summary = folder / "summary.json"
        if summary.is_file() and "val_loss" in (trained := read_json(summary, "model summary")):
            out["val_loss"][name] = trained["val_loss"]
    return out


def write_outputs(results: dict, rows: list[dict], position_rows: list[dict]) -> None:
    with atomic_dir(OUT) as tmp:
        (tmp / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (tmp / "comparison.md").write_text(report.comparison(results))
    METRICS.mkdir(exist_ok=True)
    write_json(METRICS / "eval.json", results)
    PLOT_DIR.mkdir(parents=True, exist_ok=True)
    write_csv(PLOT_DIR / "scores.csv", report.score_rows(results["tasks"], results["cells"]))
    write_csv(PLOT_DIR / "position_loss.csv", position_rows)
    from longctx.eval.plots import niah_heatmap, position_loss, score_vs_length

    score_vs_length(results["tasks"], PLOT_DIR / "score_vs_length.png", results["windows"], results["means"])
    position_loss(position_rows, PLOT_DIR / "position_loss.png")
    niah_heatmap(rows, PLOT_DIR / "niah_heatmap.png", results["windows"])


if __name__ == "__main__":
    main("eval", run, models=True, writes=(OUT,), again=f"goes on after the checkpoints it scored ({PARTIAL})")
