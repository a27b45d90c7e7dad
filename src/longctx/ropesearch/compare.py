"""The searched RoPE factors against every baseline, on the same metric and the same sequences:
needle and plain perplexity per method and length, the acceptance verdict at the target length,
and the factors per frequency (LongRoPE2's Figure 4)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config import RopeSearchParams
from ..data.loader import PackedDataset
from ..data.tokenizer import TextTokenizer
from ..eval import needle
from ..model.config import RopeConfig
from ..model.rope import inverse_frequencies
from ..model.transformer import Transformer
from ..plotting import labels, pyplot, save
from .evolve import Settings, State, search
from .space import Individual, Space, factors_of, method_ropes, rope_of, seeds

SEARCHED = "longrope2"
"""The searched factors' name among the methods."""


@dataclass
class Comparison:
    ropes: dict[str, RopeConfig]
    """Every baseline and the searched factors (SEARCHED), as the model runs them at the target."""
    state: State
    table: list[dict]
    """method_table's rows."""
    factors: dict[str, list[float]]
    """Each method's rescale factor per frequency at the target length."""
    attention: dict[str, float]
    """Each method's attention factor (cos/sin scale) at the target length: with the factors,
    its whole setting."""
    summary: dict
    """The verdict, with what the search found and spent."""


Needles = tuple[list[needle.NeedleSequence], list[needle.NeedleSequence]]


def needle_sets(data: PackedDataset, tok: TextTokenizer, space: Space, rs: RopeSearchParams) -> Needles:
    """The needle sequences at the target length the search fits, and as many held out (raises
    DataError when the data has too few documents that long: before anything is written)."""
    both = needle.sequences(data, tok, space.target, rs.sequences + rs.table_sequences, rs.needle_depth, rs.seed)
    return both[:rs.sequences], both[rs.sequences:]


def search_and_compare(model: Transformer, space: Space, data: PackedDataset, tok: TextTokenizer,
                       rs: RopeSearchParams, needles: Needles, theta_change: float | None, lengths: list[int],
                       state_path: Path) -> Comparison:
    """Search factors on the first of `needles` (resuming from `state_path`), seeded with every
    baseline (`theta_change`: ProLong's base change, when pretraining uses one), then score all
    methods on the held-out needles and plain documents at `lengths`."""
    fit_seqs, held_out = needles

    def fitness(ind: Individual) -> float:
        use_rope(model, rope_of(space, ind), space.target)
        return needle.needle_nll(model, fit_seqs, rs.batch_tokens)

    ropes = method_ropes(space, theta_change)
    settings = Settings(rs.population, rs.generations, rs.mutation, rs.crossover, rs.keep, rs.seed,
                        rs.max_evaluations, rs.max_seconds)
    state = search(space, fitness, settings, seeds(space, ropes), state_path)
    best = state.population[0]
    ropes[SEARCHED] = rope_of(space, best)
    table = method_table(model, ropes, space, data, tok, lengths, fit_seqs, held_out, rs)
    factors = {name: factors_of(r, space).tolist() for name, r in ropes.items()}
    attention = {name: attention_of(r, space) for name, r in ropes.items()}
    summary = verdict(table, space.target) | {
        "searched_equals": same_as(factors, attention), "searched_factors_equal": same_as(factors),
        "baselines_in_space": coverage(space, {n: r for n, r in ropes.items() if n != SEARCHED}),
        "critical_index_theory": space.tcd, "critical_index_searched": best.r, "attention_factor": best.attention,
        "candidates": [space.lo, space.r_max], "scale": space.scale, "evaluations": len(state.cache),
        "generations": state.generation, "stopped": state.stopped, "original_window": space.original,
        "target_length": space.target}
    return Comparison(ropes, state, table, factors, attention, summary)


def attention_of(rope: RopeConfig, space: Space) -> float:
    return float(inverse_frequencies(rope, space.head_dim, space.target, space.target)[1])


def coverage(space: Space, ropes: dict[str, RopeConfig]) -> dict[str, dict]:
    """Per baseline: whether the search space holds its whole setting, and how far the nearest
    individual (what its seed became) moved it: the largest factor change (0.0 = none; 3.0 = a
    factor 4x off) and the candidate attention factor nearest its own. Below the critical index
    the space forces NTK's shape, and factors lie in [s, factor_max * s] above it, so PI, the
    original RoPE and YaRN are outside it."""
    out = {}
    for name, rope in ropes.items():
        f, a = factors_of(rope, space), attention_of(rope, space)
        moved = min(float(np.max(np.abs(np.log(space.factors(space.project(f, r, a)) / f))))
                    for r in range(space.lo, space.r_max + 1))
        nearest = min(space.attentions, key=lambda x: abs(x - a))
        out[name] = {"in_space": moved < 1e-5 and math.isclose(nearest, a, rel_tol=1e-5),
                     "factor_moved": round(math.expm1(moved), 6), "attention": round(a, 6),
                     "nearest_attention": nearest}
    return out


def use_rope(model: Transformer, rope: RopeConfig, window: int) -> Transformer:
    """Point the model at another RoPE setting in place (the weights do not depend on it)."""
    model.cfg = model.cfg.model_copy(update={"rope": rope, "max_position_embeddings": window})
    return model


def method_table(model: Transformer, ropes: dict[str, RopeConfig], space: Space, data: PackedDataset,
                 tok: TextTokenizer, lengths: list[int], fit_seqs: list[needle.NeedleSequence],
                 held_out: list[needle.NeedleSequence], rs: RopeSearchParams) -> list[dict]:
    """Needle and plain perplexity of every method at every length, on the same sequences; at
    the target length with a bootstrap interval over the held-out sequences (`needle_ppl_lo`,
    `needle_ppl_hi`), and also on the sequences the search fitted (`needle_ppl_search`)."""
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
            row = {"method": name, "length": n}
            if n == space.target:  # per sequence, once: the perplexity and its interval
                sums, counts = needle.needle_nlls(model, seqs)
                row["needle_ppl"] = needle.perplexity(sums.sum() / max(counts.sum(), 1))
                row["needle_ppl_lo"], row["needle_ppl_hi"] = needle.ppl_interval(sums, counts, seed=rs.seed)
                row["needle_ppl_search"] = needle.perplexity(needle.needle_nll(model, fit_seqs, rs.batch_tokens))
            else:
                row["needle_ppl"] = needle.perplexity(needle.needle_nll(model, seqs, rs.batch_tokens))
            row["plain_ppl"] = needle.perplexity(needle.plain_nll(model, docs, rs.batch_tokens))
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
            # 95% bootstrap intervals over the held-out sequences: overlapping ones decide nothing
            "searched_needle_ppl_interval": [at[SEARCHED]["needle_ppl_lo"], at[SEARCHED]["needle_ppl_hi"]],
            "best_baseline_needle_ppl_interval": [baselines[best]["needle_ppl_lo"], baselines[best]["needle_ppl_hi"]],
            "searched_needle_ppl_search_set": at[SEARCHED]["needle_ppl_search"],
            "best_baseline_search_set": best_search,
            "best_baseline_needle_ppl_search_set": baselines[best_search]["needle_ppl_search"],
            # the acceptance: on the sequences every method was scored on, the searched factors are
            # not worse than the best baseline (equal up to float noise when the search lands on one)
            "searched_not_worse": at[SEARCHED]["needle_ppl_search"]
            <= baselines[best_search]["needle_ppl_search"] * (1 + 1e-4),
            # and on documents the search never saw (noisier: a handful of sequences)
            "searched_not_worse_held_out": at[SEARCHED]["needle_ppl"] <= baselines[best]["needle_ppl"] * (1 + 1e-4)}


def same_as(factors: dict[str, list[float]], attention: dict[str, float] | None = None) -> str | None:
    """The baselines whose factors the searched ones equal and, given `attention`, whose attention
    factor too (the whole setting: the search kept a seed), or None."""
    found = [b for b, f in factors.items() if b != SEARCHED and np.allclose(f, factors[SEARCHED], rtol=1e-6)
             and (attention is None or math.isclose(attention[b], attention[SEARCHED], rel_tol=1e-6))]
    return ", ".join(found) or None


def plot_factors(factors: dict[str, list[float]], space: Space, path: Path,
                 attention: dict[str, float] | None = None) -> None:
    """Factor vs frequency index for every method (LongRoPE2's Figure 4)."""
    save(factors_figure(factors, space, attention), path)


def searched_label(factors: dict[str, list[float]], attention: dict[str, float] | None) -> str:
    """The searched setting's legend entry: what it equals, or whose factors it shares with
    another attention factor (a different setting, though the lines coincide)."""
    if same := same_as(factors, attention):
        return f"{SEARCHED} (= {same}: the search found nothing better)"
    if attention and (twin := same_as(factors)):
        base = twin.split(", ")[0]
        return f"{SEARCHED} ({twin}'s factors, attention factor {attention[SEARCHED]:.4g} vs {attention[base]:.4g})"
    return SEARCHED


def factors_figure(factors: dict[str, list[float]], space: Space, attention: dict[str, float] | None = None):
    fig, ax = pyplot().subplots(figsize=(8, 4.5))
    for name, f in factors.items():
        label = name
        if name == SEARCHED:  # drawn over a baseline: the legend says so, the line dashed
            label = searched_label(factors, attention)
        ax.plot(range(len(f)), f, marker="o" if name == SEARCHED else ".", linewidth=2.2 if name == SEARCHED else 1.2,
                linestyle="--" if label != name else "-", label=label)
    ax.axvline(space.tcd, color="k", linestyle="--", linewidth=1, label=f"theoretical critical index {space.tcd}")
    ax.axhline(space.scale, color="grey", linestyle=":", linewidth=1, label=f"s = {space.scale:g}")
    ax.set_yscale("log")
    labels(ax, "frequency index i (dimension 2i)", "rescale factor lambda_i",
           f"RoPE factors, {space.original} -> {space.target} tokens")
    return fig
