"""DVC stage `rope_search`: LongRoPE2's needle-driven evolutionary search of per-frequency RoPE
factors for the model pretrain starts from, with every baseline (original RoPE, PI, NTK, YaRN,
ProLong's base change) measured on the same metric and the same sequences."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from longctx.config import Config, flat
from longctx.data.loader import PackedDataset
from longctx.data.stats import format_table
from longctx.data.tokenizer import TextTokenizer
from longctx.errors import ConfigError, DataError
from longctx.eval import needle
from longctx.io import atomic_dir, write_json
from longctx.model.config import RopeConfig
from longctx.model.transformer import Transformer
from longctx.plotting import finish, pyplot
from longctx.ropesearch.evolve import Settings, search
from longctx.ropesearch.space import Individual, Space, factors_of, method_ropes, rope_of, seeds
from longctx.tracking import stage_run
from longctx.train.models import load_model

from . import _train
from ._run import METRICS, PACKED, PLOTS, TOKENS, compute_device, main, write_csv

OUT = _train.MODELS / "rope_search"
SEARCHED = "longrope2"


def pretrain_init(cfg: Config) -> str:
    p = cfg.train.pretrain
    return str(_train.MODELS / "base") if p.init == "base" else p.init


def skip(reason: str) -> None:
    with atomic_dir(OUT) as tmp:
        write_json(tmp / "skipped.json", {"reason": reason})
    METRICS.mkdir(exist_ok=True)
    write_json(METRICS / "rope_search.json", {"skipped": True})
    print(f"rope_search: skipped ({reason})")


def use_rope(model: Transformer, rope: RopeConfig, window: int) -> Transformer:
    """Point the model at another RoPE setting in place (the weights do not depend on it)."""
    model.cfg = model.cfg.model_copy(update={"rope": rope, "max_position_embeddings": window})
    return model


def pick_split(cfg: Config, target: int) -> str:
    if cfg.rope_search.split:
        return cfg.rope_search.split
    reach = {name: s.seq_len for name, s in cfg.pack.splits.items() if s.seq_len >= target}
    if not reach:
        raise ConfigError(f"rope_search.target_length: {target} is longer than every pack split's seq_len "
                          f"({ {n: s.seq_len for n, s in cfg.pack.splits.items()} }); no documents to build "
                          "needle sequences from")
    return min(reach, key=reach.get)


def run(cfg: Config, root: Path) -> None:
    """Search RoPE factors for the target length and compare them with every baseline."""
    rs = cfg.rope_search
    init = pretrain_init(cfg)
    if not rs.enabled:
        return skip("rope_search.enabled is false")
    if cfg.model.arch == "fox" and cfg.train.pretrain.init == "base":
        return skip("the model is a FoX model (no RoPE)")
    model = load_model(init, cfg.model.attention_backend)
    if model.cfg.rope is None:
        raise DataError(f"{init}: the checkpoint has no RoPE (a FoX model); rope_search needs a RoPE model "
                        "(set rope_search.enabled: false)")
    if model.cfg.rope.type != "default":
        raise DataError(f"{init}: the checkpoint's RoPE is already scaled ({model.cfg.rope.type}); rope_search "
                        "starts from plain RoPE")
    original = rs.original_window or model.cfg.max_position_embeddings
    target = rs.target_length or 4 * original
    if target <= original:
        raise ConfigError(f"rope_search.target_length: {target} must exceed the original window {original}")
    device = compute_device()
    model = model.to(device).eval()
    space = Space(model.cfg.dim_head, model.cfg.rope.theta, original, target, rs.factor_max, rs.critical_max,
                  rs.search_attention)
    split = pick_split(cfg, target)
    data = PackedDataset(PACKED / split / "val")
    tok = TextTokenizer.load(TOKENS / "tokenizer")
    if tok.vocab_size > model.cfg.vocab_size:
        raise DataError(f"{TOKENS / 'tokenizer'}: {tok.vocab_size} tokens, the checkpoint's vocabulary has "
                        f"{model.cfg.vocab_size}: the tokenizer does not match the checkpoint")
    both = needle.sequences(data, tok, target, rs.sequences + rs.table_sequences, rs.needle_depth, rs.seed)
    fit_seqs, held_out = both[:rs.sequences], both[rs.sequences:]

    def fitness(ind: Individual) -> float:
        use_rope(model, rope_of(space, ind), target)
        return needle.needle_nll(model, fit_seqs, rs.batch_tokens)

    theta_change = next((s.rope_theta for s in cfg.train.pretrain.stages if s.rope_theta), None)
    ropes = method_ropes(space, theta_change)
    settings = Settings(rs.population, rs.generations, rs.mutation, rs.crossover, rs.keep, rs.seed,
                        rs.max_evaluations, rs.max_seconds)
    with stage_run(cfg.tracking, root, "rope_search", flat(rs, "rope_search") | {"init": init}) as tracker:
        folder = _run_folder(cfg, init, split)
        folder.mkdir(parents=True, exist_ok=True)
        state = search(space, fitness, settings, seeds(space, ropes), folder / "state.json")
        best = state.population[0]
        ropes[SEARCHED] = rope_of(space, best)
        for h in state.history:
            tracker.metrics({"search.best_needle_nll": h["best"], "search.mean_needle_nll": h["mean"],
                             "search.evaluations": h["evaluations"]}, step=h["generation"])
        lengths = sorted({original, target, *[n for n in rs.lengths if n <= data.seq_len]})
        table = method_table(model, ropes, space, data, tok, lengths, fit_seqs, held_out, rs)
        print(format_table({f"{r['method']} @ {r['length']}": r for r in table},
                           ["needle_ppl_search", "needle_ppl", "plain_ppl"], key="method @ length"))
        factors = {name: factors_of(r, space).tolist() for name, r in ropes.items()}
        summary = verdict(table, target)
        summary |= {"critical_index_theory": space.tcd, "critical_index_searched": best.r,
                    "attention_factor": best.attention,
                    "candidates": [space.lo, space.r_max], "scale": space.scale, "evaluations": len(state.cache),
                    "generations": state.generation, "stopped": state.stopped, "split": split,
                    "original_window": original, "target_length": target}
        with atomic_dir(OUT) as tmp:
            write_json(tmp / "factors.json", hf_form(ropes[SEARCHED], space) | {"searched_on": init})
            write_json(tmp / "methods.json", factors)
            (tmp / "history.jsonl").write_text("".join(json.dumps(h) + "\n" for h in state.history))
            write_csv(tmp / "table.csv", table)
        METRICS.mkdir(exist_ok=True)
        write_json(METRICS / "rope_search.json", {"summary": summary, "table": table})
        PLOTS.mkdir(exist_ok=True)
        write_csv(PLOTS / "rope_search_fitness.csv",
                   [{"generation": h["generation"], "best": h["best"], "mean": h["mean"]} for h in state.history])
        plot_factors(factors, space, PLOTS / "rope_factors.png")
        tracker.metrics({k: v for k, v in summary.items() if isinstance(v, (int, float))})
        for f in ("factors.json", "table.csv", "history.jsonl"):
            tracker.artifact(OUT / f)
        tracker.artifact(PLOTS / "rope_factors.png")
        print(f"rope_search: {SEARCHED} needle ppl {summary['searched_needle_ppl']:.3f} vs best baseline "
              f"{summary['best_baseline']} {summary['best_baseline_needle_ppl']:.3f} at {target} (held-out sequences)")


def method_table(model, ropes: dict[str, RopeConfig], space: Space, data: PackedDataset, tok, lengths: list[int],
                 fit_seqs, held_out, rs) -> list[dict]:
    """Needle and plain perplexity of every method at every length, on the same sequences."""
    rows = []
    per_length = {}
    for n in lengths:
        seqs = held_out if n == space.target else needle.sequences(data, tok, n, rs.table_sequences,
                                                                  rs.needle_depth, rs.seed + n)
        docs = [np.asarray(data[i].input_ids[:n]) for i in needle.long_documents(data, n)[:rs.table_sequences]]
        per_length[n] = (seqs, docs)
    for name, rope in ropes.items():
        use_rope(model, rope, space.target)
        for n in lengths:
            seqs, docs = per_length[n]
            row = {"method": name, "length": n,
                   "needle_ppl": needle.perplexity(needle.needle_nll(model, seqs, rs.batch_tokens)),
                   "plain_ppl": needle.perplexity(needle.plain_nll(model, docs, rs.batch_tokens))}
            if n == space.target:
                row["needle_ppl_search"] = needle.perplexity(needle.needle_nll(model, fit_seqs, rs.batch_tokens))
            rows.append({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
    return rows


def verdict(table: list[dict], target: int) -> dict:
    """The searched factors against the best baseline at the target length."""
    at = {r["method"]: r for r in table if r["length"] == target}
    baselines = {m: r for m, r in at.items() if m != SEARCHED}
    best = min(baselines, key=lambda m: baselines[m]["needle_ppl"])
    best_search = min(baselines, key=lambda m: baselines[m]["needle_ppl_search"])
    return {"searched_needle_ppl": at[SEARCHED]["needle_ppl"], "best_baseline": best,
            "best_baseline_needle_ppl": baselines[best]["needle_ppl"],
            "searched_needle_ppl_search_set": at[SEARCHED]["needle_ppl_search"],
            "best_baseline_search_set": best_search,
            "best_baseline_needle_ppl_search_set": baselines[best_search]["needle_ppl_search"],
            # the acceptance: on the sequences every method was scored on, the searched factors are
            # not worse than the best baseline (equal up to float noise when the search lands on one)
            "searched_not_worse": at[SEARCHED]["needle_ppl_search"]
            <= baselines[best_search]["needle_ppl_search"] * (1 + 1e-4),
            # and on documents the search never saw (noisier: a handful of sequences)
            "searched_not_worse_held_out": at[SEARCHED]["needle_ppl"] <= baselines[best]["needle_ppl"] * (1 + 1e-4)}


def hf_form(rope: RopeConfig, space: Space) -> dict:
    """What HF's rope_scaling takes for 'longrope' (and pretrain's train.pretrain.factors)."""
    return {"rope_type": "longrope", "short_factor": rope.short_factor, "long_factor": rope.long_factor,
            "original_max_position_embeddings": space.original, "factor": space.scale,
            "attention_factor": rope.attention_factor,
            "rope_theta": space.theta}


def plot_factors(factors: dict[str, list[float]], space: Space, path: Path) -> None:
    """Factor vs frequency index for every method (LongRoPE2's Figure 4)."""
    fig, ax = pyplot().subplots(figsize=(8, 4.5))
    for name, f in factors.items():
        ax.plot(range(len(f)), f, marker="o" if name == SEARCHED else ".", linewidth=2.2 if name == SEARCHED else 1.2,
                label=name)
    ax.axvline(space.tcd, color="k", linestyle="--", linewidth=1, label=f"theoretical critical index {space.tcd}")
    ax.axhline(space.scale, color="grey", linestyle=":", linewidth=1, label=f"s = {space.scale:g}")
    ax.set_yscale("log")
    finish(fig, ax, path, "frequency index i (dimension 2i)", "rescale factor lambda_i",
           f"RoPE factors, {space.original} -> {space.target} tokens")


def _run_folder(cfg: Config, init: str, split: str) -> Path:
    """The search state resumes only for the same settings, starting model and data."""
    key = json.dumps([cfg.rope_search.model_dump(mode="json"), init, _train.fingerprint(Path(init)),
                      _train.fingerprint(PACKED / split / "val")], sort_keys=True)
    return _train.RUNS / "rope_search" / hashlib.sha256(key.encode()).hexdigest()[:12]


if __name__ == "__main__":
    main("rope_search", run)
