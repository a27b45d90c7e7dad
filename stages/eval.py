"""DVC stage `eval`: every checkpoint the pipeline made (base, each pretrain stage, sft), the same
prompts for all: RULER/HELMET-style tasks by greedy decoding, per-position loss, perplexity
against context length, needle perplexity, and short-context retention."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from longctx.config import Config, flat
from longctx.data.loader import PackedDataset
from longctx.data.tokenizer import TextTokenizer
from longctx.errors import ConfigError, DataError
from longctx.eval import needle, suite
from longctx.io import atomic_dir, write_json
from longctx.model.hf import native_config
from longctx.tracking import stage_run
from longctx.train.models import load_model

from . import _train
from ._run import METRICS, PACKED, PLOTS, TOKENS, compute_device, main, write_csv

OUT = Path("reports") / "eval"
PLOT_DIR = PLOTS / "eval"


def checkpoints(cfg: Config) -> dict[str, Path]:
    """Name -> folder of every checkpoint the pipeline made, in training order."""
    out = {}
    if cfg.train.base is not None:
        out["base"] = _train.MODELS / "base"
    for stage in cfg.train.pretrain.stages:
        out[f"pretrain_{stage.split}"] = _train.MODELS / "pretrain" / stage.split
    out["sft"] = _train.MODELS / "sft"
    for name, folder in out.items():
        if not (folder / "longctx_config.json").is_file():
            raise DataError(f"{folder}: checkpoint {name!r} is missing (run the stage that makes it)")
    return out


def long_split(cfg: Config) -> PackedDataset:
    """The validation part of the split with the longest sequences (long documents)."""
    name = max(cfg.pack.splits, key=lambda s: cfg.pack.splits[s].seq_len)
    return PackedDataset(PACKED / name / "val")


def retention_split(cfg: Config) -> PackedDataset | None:
    name = cfg.eval.retention_split or (cfg.train.base.split if cfg.train.base else None)
    return PackedDataset(PACKED / name / "val") if name else None


def run(cfg: Config, root: Path) -> None:
    """Evaluate every checkpoint with the same prompts."""
    ec = cfg.eval
    ckpts = checkpoints(cfg)
    tok = TextTokenizer.load(TOKENS / "tokenizer")
    windows = {}
    for name, folder in ckpts.items():  # check every checkpoint (its config) before evaluating any
        mcfg = native_config(folder)
        if tok.vocab_size > mcfg.vocab_size:
            raise DataError(f"{TOKENS / 'tokenizer'}: {tok.vocab_size} tokens but checkpoint {folder} has a "
                            f"vocabulary of {mcfg.vocab_size}: the tokenizer does not match the checkpoint")
        windows[name] = mcfg.max_position_embeddings if mcfg.rope is not None else None
    longest = max(w or 10**9 for w in windows.values())
    too_long = [n for n in ec.lengths if n > longest]
    if too_long:
        raise ConfigError(f"eval.lengths: {too_long} exceed every checkpoint's window (the longest is {longest})")
    data = long_split(cfg)
    haystack = tok.tok.decode(data[needle.long_documents(data, 1)[0]].input_ids.tolist())
    device = compute_device()
    results: dict = {"tasks": {}, "throughput": {}, "position_loss": {}, "ppl_by_length": {}, "needle_ppl": {},
                     "retention_ppl": {}, "skipped": [],
                     "not_computed": {"helmet_gpt4o_judged": "GPT-4o-judged metrics (HELMET summarization, QA "
                                                             "judge) need an external API; not computed"}}
    rows_all, position_rows = [], []
    with stage_run(cfg.tracking, root, "eval", flat(ec, "eval")) as tracker:
        for name, folder in ckpts.items():
            model = load_model(folder, cfg.model.attention_backend).to(device).eval()
            limit = windows[name]
            lengths = [n for n in ec.lengths if limit is None or n <= limit]
            for n in sorted(set(ec.lengths) - set(lengths)):
                results["skipped"].append({"checkpoint": name, "length": n,
                                           "reason": f"beyond the checkpoint's window {limit}"})
            chat = name == "sft"
            if chat and not tok.chat_template:
                raise DataError(f"{TOKENS / 'tokenizer'}: no chat template to evaluate the SFT checkpoint with")
            enc = suite.Encoder(tok, chat)
            prompts = suite.build_prompts(enc, ec.tasks, lengths, ec.samples, ec.depths, ec.seed, haystack)
            prompts += _helmet_prompts(enc, ec, lengths, name, results)
            answer = (suite.hf_answerer(folder / "hf", enc.eos()) if ec.backend == "transformers"
                      else suite.our_answerer(model, enc.eos()))
            rows, speed = suite.run_tasks(answer, enc, prompts, f"eval {name}")
            for r in rows:
                r["checkpoint"] = name
            rows_all += rows
            results["tasks"][name] = _mean_scores(rows)
            results["throughput"][name] = speed
            tracker.metrics({f"{name}.{t}.{n}": v for t, by in results["tasks"][name].items() for n, v in by.items()})
            tracker.metrics({f"{name}.prompts_per_s": speed["prompts_per_s"], f"{name}.tokens_per_s": speed["tokens_per_s"]})
            _perplexities(model, name, data, tok, ec, results, position_rows)
            if ec.lm_eval_tasks:
                _lm_eval(model, tok, name, ec, results)
            short = retention_split(cfg)
            if short is not None:
                seqs = [short[i] for i in range(min(ec.retention_sequences, len(short)))]
                loss = suite.mean_loss(model, [s.input_ids for s in seqs])
                results["retention_ppl"][name] = needle.perplexity(loss)
        write_outputs(results, rows_all, position_rows)
        for f in ("scores.csv", "position_loss.csv", "score_vs_length.png", "position_loss.png", "niah_heatmap.png"):
            tracker.artifact(PLOT_DIR / f)
        tracker.artifact(OUT / "comparison.md")
        tracker.metrics({f"{c}.retention_ppl": v for c, v in results["retention_ppl"].items()})
    print((OUT / "comparison.md").read_text())


def _perplexities(model, name: str, data: PackedDataset, tok, ec, results: dict, position_rows: list) -> None:
    """Per-position loss at the longest length documents reach, perplexity and needle perplexity
    at every eval length documents reach (inside and beyond the training window)."""
    reach = [n for n in sorted(set(ec.lengths) | {data.seq_len}) if n <= data.seq_len]
    docs_at = {n: needle.long_documents(data, n)[:ec.position_sequences] for n in reach}
    reach = [n for n in reach if docs_at[n]]
    if not reach:
        results["skipped"].append({"checkpoint": name, "task": "perplexity", "reason": "no long validation documents"})
        return
    top = reach[-1]
    losses = suite.position_loss(model, [data[i].input_ids[:top] for i in docs_at[top]])
    for pos, value in zip(*suite.smooth(losses), strict=True):
        position_rows.append({"checkpoint": name, "position": pos, "loss": value})
    results["position_loss"][name] = {"positions": top, "mean": float(losses.mean())}
    results["ppl_by_length"][name] = {
        n: needle.perplexity(suite.mean_loss(model, [data[i].input_ids[:n] for i in docs_at[n]])) for n in reach}
    results["needle_ppl"][name] = {}
    for n in reach:
        try:
            seqs = needle.sequences(data, tok, n, min(ec.needle_sequences, len(docs_at[n])), 0.05, ec.seed)
        except DataError as e:
            results["skipped"].append({"checkpoint": name, "task": "needle_ppl", "length": n, "reason": str(e)})
            continue
        results["needle_ppl"][name][n] = needle.perplexity(needle.needle_nll(model, seqs))


def _helmet_prompts(enc, ec, lengths: list[int], name: str, results: dict) -> list:
    """HELMET dataset prompts; a dataset that cannot be loaded is skipped with the reason."""
    from longctx.eval import helmet
    from longctx.eval.tasks import Budget

    out = []
    for ds_name, spec in ec.helmet.items():
        src = helmet.Source(spec.kind, spec.path, spec.split, dict(spec.fields))
        try:
            rows = helmet.load_rows(src, spec.limit)
        except DataError as e:
            results["skipped"].append({"checkpoint": name, "task": f"helmet:{ds_name}", "reason": str(e)[:300]})
            continue
        for length in lengths:
            for i in range(ec.samples):
                rng = np.random.default_rng([ec.seed, length, i, len(ds_name)])
                out.append(helmet.build(src, rows, Budget(enc.count, length, reserve=24), rng,
                                        ec.depths[i % len(ec.depths)], ds_name))
        if spec.kind in helmet.JUDGED:
            results["not_computed"][f"helmet:{ds_name}"] = helmet.JUDGED[spec.kind]
    return out


def _lm_eval(model, tok, name: str, ec, results: dict) -> None:
    """Short-context retention through lm-eval-harness; a task whose data cannot be had is
    reported as skipped with the reason, never as a score."""
    from longctx.eval.lm_harness import evaluate

    results.setdefault("lm_eval", {})[name] = {}
    for task in ec.lm_eval_tasks:
        try:
            results["lm_eval"][name] |= evaluate(model, tok, [task], limit=ec.lm_eval_limit)
        except Exception as e:  # lm-eval raises many kinds (missing dataset, no network, bad task name)
            results["skipped"].append({"checkpoint": name, "task": f"lm_eval:{task}", "reason": f"{type(e).__name__}: {e}"[:300]})


def _mean_scores(rows: list[dict]) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, list[float]]] = {}
    for r in rows:
        out.setdefault(r["task"], {}).setdefault(r["length"], []).append(r["score"])
    return {t: {n: float(np.mean(v)) for n, v in by.items()} for t, by in out.items()}


def write_outputs(results: dict, rows: list[dict], position_rows: list[dict]) -> None:
    with atomic_dir(OUT) as tmp:
        (tmp / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (tmp / "comparison.md").write_text(comparison(results))
    METRICS.mkdir(exist_ok=True)
    write_json(METRICS / "eval.json", results)
    PLOT_DIR.mkdir(parents=True, exist_ok=True)
    score_rows = [{"checkpoint": c, "task": t, "length": n, "score": v}
                  for c, by_task in results["tasks"].items() for t, by in by_task.items() for n, v in by.items()]
    write_csv(PLOT_DIR / "scores.csv", score_rows)
    write_csv(PLOT_DIR / "position_loss.csv", position_rows)
    from longctx.eval.plots import niah_heatmap, position_loss, score_vs_length

    score_vs_length(results["tasks"], PLOT_DIR / "score_vs_length.png")
    position_loss(position_rows, PLOT_DIR / "position_loss.png")
    niah_heatmap(rows, PLOT_DIR / "niah_heatmap.png")


def comparison(results: dict) -> str:
    """A Markdown table: each checkpoint's mean task score per length, retention and throughput."""
    names = list(results["tasks"])
    lengths = sorted({n for by_task in results["tasks"].values() for by in by_task.values() for n in by})
    head = ["checkpoint", *[f"tasks@{n}" for n in lengths], "retention ppl", "prompts/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in names:
        cells = [c]
        for n in lengths:
            vals = [by[n] for by in results["tasks"][c].values() if n in by]
            cells.append(f"{np.mean(vals):.3f}" if vals else "skipped")
        ret = results["retention_ppl"].get(c)
        cells += [f"{ret:.2f}" if ret else "n/a", f"{results['throughput'][c]['prompts_per_s']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main("eval", run)
