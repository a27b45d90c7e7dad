"""DVC stage `rope_search`: LongRoPE2's needle-driven evolutionary search of per-frequency RoPE
factors for the model pretrain starts from, with every baseline (original RoPE, PI, NTK, YaRN,
ProLong's base change) measured on the same metric and the same sequences."""

from __future__ import annotations

if not __package__:  # `python stages/rope_search.py`: stages/ leads sys.path, its tokenize.py shadows Python's
    raise SystemExit("run it as `python -m stages.rope_search` from the project root (or `dvc repro rope_search`)")

import hashlib
import json
from pathlib import Path

from longctx.config import Params, flat
from longctx.data.loader import PackedDataset
from longctx.data.stats import format_table
from longctx.errors import ConfigError, DataError
from longctx.io import atomic_dir, write_json
from longctx.model.rope import hf_rope_parameters
from longctx.plotting import notice
from longctx.ropesearch.compare import SEARCHED, needle_sets, plot_factors, search_and_compare
from longctx.ropesearch.space import Space
from longctx.tracking.runs import stage_run

from . import _train
from ._run import METRICS, PACKED, PLOTS, TOKENS, compute_device, main, tokenizer, write_csv

OUT = _train.MODELS / "rope_search"


def pretrain_init(cfg: Params) -> str:
    p = cfg.train.pretrain
    return str(_train.MODELS / "base") if p.init == "base" else p.init


FITNESS = PLOTS / "rope_search_fitness.csv"
FACTORS = PLOTS / "rope_factors.png"


def skip(reason: str) -> None:
    """Every output DVC expects of the stage, saying why it did not search."""
    with atomic_dir(OUT) as tmp:
        write_json(tmp / "skipped.json", {"reason": reason})
    METRICS.mkdir(exist_ok=True)
    write_json(METRICS / "rope_search.json", {"skipped": True})
    PLOTS.mkdir(exist_ok=True)
    FITNESS.write_text("generation,best,mean\n")  # no generations
    notice(FACTORS, "rope_search: skipped", reason)
    print(f"rope_search: skipped ({reason})")


def pick_split(cfg: Params, target: int) -> str:
    if cfg.rope_search.split:
        return cfg.rope_search.split
    reach = {name: s.seq_len for name, s in cfg.pack.splits.items() if s.seq_len >= target}
    if not reach:
        raise ConfigError(f"rope_search.target_length: {target} is longer than every pack split's seq_len "
                          f"({ {n: s.seq_len for n, s in cfg.pack.splits.items()} }); no documents to build "
                          "needle sequences from")
    return min(reach, key=reach.get)


def run(cfg: Params, root: Path) -> None:
    """Search RoPE factors for the target length and compare them with every baseline."""
    rs = cfg.rope_search
    init = pretrain_init(cfg)
    if not rs.enabled:
        return skip("rope_search.enabled is false")
    position = cfg.model.position or ("none" if cfg.model.arch == "fox" else "rope")
    if position != "rope" and cfg.train.pretrain.init == "base":
        return skip(f"the model has no RoPE (position: {position}{', a FoX model' if cfg.model.arch == 'fox' else ''})")
    model = _train.load(init, cfg.model.attention_backend)
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
    tok, _ = tokenizer()
    if tok.vocab_size > model.cfg.vocab_size:
        raise DataError(f"{TOKENS / 'tokenizer'}: {tok.vocab_size} tokens, the checkpoint's vocabulary has "
                        f"{model.cfg.vocab_size}: the tokenizer does not match the checkpoint")
    needles = needle_sets(data, tok, space, rs)
    theta_change = next((s.rope_theta for s in cfg.train.pretrain.stages if s.rope_theta), None)
    lengths = sorted({original, target, *[n for n in rs.lengths if n <= data.seq_len]})
    with stage_run(cfg.tracking, root, "rope_search", flat(rs, "rope_search") | {"init": init}) as tracker:
        folder = _run_folder(cfg, init, split)
        folder.mkdir(parents=True, exist_ok=True)
        result = search_and_compare(model, space, data, tok, rs, needles, theta_change, lengths,
                                    folder / "state.json")
        state, table, factors = result.state, result.table, result.factors
        summary = result.summary | {"split": split}
        for h in state.history:
            tracker.metrics({"search.best_needle_nll": h["best"], "search.mean_needle_nll": h["mean"],
                             "search.evaluations": h["evaluations"]}, step=h["generation"])
        print(format_table({f"{r['method']} @ {r['length']}": r for r in table},
                           ["needle_ppl_search", "needle_ppl", "needle_ppl_lo", "needle_ppl_hi", "plain_ppl"],
                           key="method @ length"))
        with atomic_dir(OUT) as tmp:
            write_json(tmp / "factors.json", hf_rope_parameters(result.ropes[SEARCHED]) | {"searched_on": init})
            write_json(tmp / "methods.json", {"factors": factors, "attention_factor": result.attention})
            (tmp / "history.jsonl").write_text("".join(json.dumps(h) + "\n" for h in state.history))
            write_csv(tmp / "table.csv", table)
        METRICS.mkdir(exist_ok=True)
        write_json(METRICS / "rope_search.json", {"summary": summary, "table": table})
        PLOTS.mkdir(exist_ok=True)
        write_csv(FITNESS,
                   [{"generation": h["generation"], "best": h["best"], "mean": h["mean"]} for h in state.history])
        plot_factors(factors, space, FACTORS, result.attention)
        tracker.metrics({k: v for k, v in summary.items() if isinstance(v, (int, float))})
        for f in ("factors.json", "table.csv", "history.jsonl"):
            tracker.artifact(OUT / f)
        tracker.artifact(FACTORS)
        lo, hi = summary["searched_needle_ppl_interval"]
        blo, bhi = summary["best_baseline_needle_ppl_interval"]
        print(f"rope_search: {SEARCHED} needle ppl {summary['searched_needle_ppl']:.3f} [{lo:.3f}, {hi:.3f}] vs best "
              f"baseline {summary['best_baseline']} {summary['best_baseline_needle_ppl']:.3f} [{blo:.3f}, {bhi:.3f}] "
              f"at {target} ({len(needles[1])} held-out sequences, 95% bootstrap intervals; the search fitted "
              f"{len(needles[0])} others)")
        outside = [f"{b} (factors moved up to {c['factor_moved']:.0%}, attention factor {c['attention']:.4g} -> "
                   f"{c['nearest_attention']:.4g})"
                   for b, c in summary["baselines_in_space"].items() if not c["in_space"]]
        if outside:
            print("rope_search: outside the search space, so seeded as their nearest individuals: "
                  + "; ".join(outside))
        if summary["searched_equals"]:
            print(f"rope_search: the searched setting is {summary['searched_equals']}'s (factors and attention "
                  "factor): the search found nothing better than the baselines (more generations or a larger "
                  "population may)")
        elif twin := summary["searched_factors_equal"]:
            print(f"rope_search: the searched factors are {twin}'s, with attention factor "
                  f"{result.attention[SEARCHED]:.4g} against {result.attention[twin.split(', ')[0]]:.4g}: a setting "
                  "of its own")


def _run_folder(cfg: Params, init: str, split: str) -> Path:
    """The search state resumes only for the same settings, starting model and data."""
    key = json.dumps([cfg.rope_search.model_dump(mode="json"), init, _train.fingerprint(Path(init)),
                      _train.fingerprint(PACKED / split / "val")], sort_keys=True)
    return _train.RUNS / "rope_search" / hashlib.sha256(key.encode()).hexdigest()[:12]


if __name__ == "__main__":
    main("rope_search", run, models=True, writes=(OUT,))
