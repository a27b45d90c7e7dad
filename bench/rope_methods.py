"""Every way to stretch RoPE past its window, on one base model, zero-shot and after the same
fine-tune (issue 33; LongRoPE2's claims, arXiv:2502.20082). A RoPE model is trained at W on synthetic
retrieval documents and real short text (bench/tiny_retrieval.py's data and loop); each method —
the original RoPE, PI, NTK, YaRN, ProLong's base change (theta x16) and LongRoPE2's factors,
searched as the rope_search stage searches them (needle sequences at 4W, every baseline a seed),
and LongRoPE2 searched in a wider space (`WIDE`) — is set for 4W and scored as is, then fine-tuned
the same steps on the same documents of mixed lengths packed in 4W windows (under LongRoPE2's
factors a document inside W runs the original RoPE: its mixed context window training) and scored
again. On documents nothing here trained or
searched on: passkey and NIAH-single at W, 4W and 8W; needle perplexity at 4W (held-out needle
sequences, 95% bootstrap interval); the loss by position to 8W; the loss on W-token prefixes of
held-out long documents (short-context retention). Writes the JSON and a figure; prints the table
and the issue's targets (LongRoPE2 after fine-tuning >= every baseline on needle perplexity at 4W
and passkey at 8W, its short-text loss within 1% of the best baseline's), per seed.

    python -m bench.rope_methods --long data/packed/stage2/train --prompts 8   # GPU
(in a workspace whose corpora, tokenize and pack stages ran with the tiny profile: its stage-2 split holds
documents of 8W = 4,096 tokens; the bench trains on none of them, so either part is held out)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from bench.tiny_retrieval import Variant, fit, new_model, score_rows, task_prompts, training_data, variant_fields
from longctx.config.eval_params import RopeSearchParams
from longctx.data.loader import PackedDataset
from longctx.data.shards import ShardReader
from longctx.data.tokenizer import TextTokenizer
from longctx.eval import needle
from longctx.eval.suite import Encoder
from longctx.perf import write_result
from longctx.plotting import labels, pyplot, save
from longctx.ropesearch.compare import SEARCHED, needle_sets, search_and_compare, use_rope
from longctx.ropesearch.space import Space

BASE = Variant(steps=1000, batch=16, seq_len=512, d_model=512, n_layers=8, n_heads=8, ffn_dim=1376, lr=1e-3,
               lr_min=1e-4, path="stage", compile=False)
"""The base at W = 512: a ~33M-parameter model (8,192-token vocabulary), as the issue's. Trained
as a stage trains on its device (bf16 compute copies, one varlen attention call a layer on a GPU):
the "fp32" path's per-document attention took 280 s for this base on an H100, 50 s a fine-tune.
Not compiled: each fine-tuned copy is a new module (a recompilation each) and trains 120 steps."""
TUNE = {"steps": 120, "batch": 8, "lr": 2e-4, "lr_min": 2e-5}
"""The fine-tune at 4W, the same for every method (Variant fields over the base's)."""
WIDE = "longrope2_wide"
"""LongRoPE2's search in a wider space than the paper's (issue 33 item 3): the critical index may
reach the last frequency (so NTK's shape is inside) and the attention factor is searched (1 beside
the paper's). Scored and tuned like the others; not a baseline of the targets."""
METHODS = ("original", "pi", "ntk", "yarn", "base_change", SEARCHED, WIDE)
RUN_ORDER = (SEARCHED, "yarn", "ntk", "base_change", "pi", "original", WIDE)
"""The order they are tuned in: the method under test and its closest rivals first, so that a run
cut short by its time limit still holds the comparison that matters (each method's rows are
written as they come: `partial`)."""


@dataclasses.dataclass
class Scoring:
    """What every model is scored on, built once per seed: none of it trained or searched on."""

    enc: Encoder
    prompts: list
    held_out: list
    """Needle sequences at 4W, from other documents than the search's."""
    long_docs: list[np.ndarray]
    """8W-token documents for the loss by position."""
    short_docs: list[np.ndarray]
    """W-token prefixes of held-out documents (short-context retention)."""
    window: int
    bf16: bool
    """Score under bf16 autocast (as the eval stage scores a GPU model)."""


def score(model, rope, s: Scoring, device: torch.device) -> dict:
    """One model under one RoPE setting (for 4W), on everything in `s`."""
    w = s.window
    use_rope(model, rope, 4 * w)
    lengths = [w, 4 * w, 8 * w]
    row = score_rows(model, s.enc, s.prompts, lengths, device, s.bf16)
    sums, counts = needle.needle_nlls(model, s.held_out)
    row["needle_ppl"] = needle.perplexity(float(sums.sum() / max(counts.sum(), 1)))
    row["needle_ppl_interval"] = list(needle.ppl_interval(sums, counts))
    curve = needle.position_loss(model, s.long_docs)
    row["position_loss"] = {f"[{a}W,{b}W)": float(curve[a * w:b * w - 1].mean()) for a, b in ((0, 1), (1, 4), (4, 8))}
    row["position_curve"] = [float(c.mean()) for c in np.array_split(curve, 64)]  # 64 points to 8W
    row["short_loss"] = needle.plain_nll(model, s.short_docs)
    return row


def scoring(tok: TextTokenizer, long: PackedDataset, held_out: list, w: int, prompts: int, seed: int,
            bf16: bool) -> Scoring:
    docs = needle.long_documents(long, 8 * w)
    if len(docs) < 2:
        raise SystemExit(f"{long.folder}: {len(docs)} documents of >= {8 * w} tokens; the loss by position needs 2")
    rng = np.random.default_rng(seed)
    long_docs = [np.asarray(long[int(i)].input_ids[:8 * w]) for i in rng.choice(docs, min(8, len(docs)), replace=False)]
    short_docs = [np.asarray(long[i].input_ids[:w]) for i in needle.long_documents(long, w)[:32]]
    enc = Encoder(tok, chat=False)
    return Scoring(enc, task_prompts(enc, [w, 4 * w, 8 * w], prompts), held_out, long_docs, short_docs, w, bf16)


def one_seed(seed: int, args: argparse.Namespace, tok: TextTokenizer, readers: list[ShardReader],
             long: PackedDataset, device: torch.device, partial: Callable[[dict], None]) -> dict:
    """Base, search, then every method zero-shot and fine-tuned, for one seed; `partial` gets the
    seed's result so far after each method."""
    base_v = dataclasses.replace(args.base, seed=seed)
    w = base_v.seq_len
    t0 = time.perf_counter()
    model = new_model(base_v, tok, device)
    fit(model, base_v, training_data(base_v, tok, readers, args.packed), device)
    base_s = time.perf_counter() - t0
    print(f"seed {seed}: base trained in {base_s:.0f} s", flush=True)
    rs = args.search.model_copy(update={"seed": seed})
    space = Space(model.cfg.dim_head, base_v.theta, w, 4 * w, rs.factor_max, rs.critical_max, rs.search_attention)
    needles = needle_sets(long, tok, space, rs)
    t1 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        found = search_and_compare(model, space, long, tok, rs, needles, 16 * base_v.theta, [4 * w],
                                   Path(tmp) / "state.json")
        wide = search_and_compare(model, dataclasses.replace(space, critical_max="all", search_attention=True), long,
                                  tok, rs, needles, 16 * base_v.theta, [4 * w], Path(tmp) / "wide.json")
    ropes = found.ropes | {WIDE: wide.ropes[SEARCHED]}
    factors = found.factors | {WIDE: wide.factors[SEARCHED]}
    attention = found.attention | {WIDE: wide.attention[SEARCHED]}
    print(f"seed {seed}: searched and compared in {time.perf_counter() - t1:.0f} s", flush=True)
    s = scoring(tok, long, needles[1], w, args.prompts, seed, base_v.path == "stage" and device.type == "cuda")
    # documents of 120 characters up to ~4W tokens: short ones run the original RoPE under LongRoPE2's factors
    tune_v = dataclasses.replace(base_v, seq_len=4 * w, max_chars=int(4 * w * args.chars_per_token), **args.tune)
    tune_data = training_data(tune_v, tok, readers, args.packed)
    methods = {}
    result = {"seed": seed, "base_s": base_s, "search": found.summary, "search_table": found.table,
              "search_wide": wide.summary, "methods": methods}
    for name in RUN_ORDER:
        rope = ropes[name]
        # a fresh module, not a deepcopy: under path "stage" the base carries bf16 copies feeding its own grads
        tuned = new_model(base_v, tok, device)
        tuned.load_state_dict(model.state_dict())
        use_rope(tuned, rope, 4 * w)
        t1 = time.perf_counter()
        fit(tuned, tune_v, tune_data, device)
        t2 = time.perf_counter()
        methods[name] = {"zero_shot": score(model, rope, s, device), "tuned": score(tuned, rope, s, device),
                         "tune_s": t2 - t1, "score_s": time.perf_counter() - t2, "factors": factors[name],
                         "attention_factor": attention[name]}
        print(f"seed {seed} {name} (tuned in {t2 - t1:.0f} s, scored in {time.perf_counter() - t2:.0f} s): zero-shot "
              f"{json.dumps(row_summary(methods[name]['zero_shot'], w))}, "
              f"tuned {json.dumps(row_summary(methods[name]['tuned'], w))}", flush=True)
        partial(result)
    ordered = {m: methods[m] for m in METHODS}
    return result | {"methods": ordered, "targets": targets(ordered, w)}


def row_summary(row: dict, w: int) -> dict:
    return {"needle_ppl": round(row["needle_ppl"], 2), "short_loss": round(row["short_loss"], 4),
            **{f"passkey_{m}W": row[f"passkey_{m * w}"] for m in (1, 4, 8)},
            **{f"niah_{m}W": row[f"niah_single_noise_{m * w}"] for m in (1, 4, 8)}}


def targets(methods: dict, w: int) -> dict:
    """The issue's targets after fine-tuning: LongRoPE2 against the best baseline on each."""
    tuned = {m: r["tuned"] for m, r in methods.items()}
    base = {m: r for m, r in tuned.items() if m not in (SEARCHED, WIDE)}
    ours = tuned[SEARCHED]
    best_ppl = min(r["needle_ppl"] for r in base.values())
    best_passkey = max(r[f"passkey_{8 * w}"] for r in base.values())
    best_short = min(r["short_loss"] for r in base.values())
    return {"needle_ppl_4W": {"longrope2": ours["needle_ppl"], "best_baseline": best_ppl,
                              "met": ours["needle_ppl"] <= best_ppl},
            "passkey_8W": {"longrope2": ours[f"passkey_{8 * w}"], "best_baseline": best_passkey,
                           "met": ours[f"passkey_{8 * w}"] >= best_passkey},
            "short_loss_within_1pct": {"longrope2": ours["short_loss"], "best_baseline": best_short,
                                       "met": ours["short_loss"] <= best_short * 1.01}}


def plot(results: list[dict], w: int, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    x = np.arange(len(METHODS))
    for k, r in enumerate(results):
        shift = (k - (len(results) - 1) / 2) * 0.35
        for j, (when, hatch) in enumerate((("zero_shot", "//"), ("tuned", ""))):
            ppl = [r["methods"][m][when]["needle_ppl"] for m in METHODS]
            axes[0].bar(x + shift + (j - 0.5) * 0.17, ppl, 0.17, hatch=hatch, color=f"C{k}",
                        alpha=0.5 if when == "zero_shot" else 1.0, label=f"seed {r['seed']} {when.replace('_', '-')}")
        for m_i, m in enumerate(METHODS):
            passkey = [r["methods"][m]["tuned"][f"passkey_{n * w}"] for n in (1, 4, 8)]
            axes[1].plot([1, 4, 8], passkey, marker="o", color=f"C{m_i}", ls="-" if k == 0 else "--",
                         label=m if k == 0 else None)
            if k == 0:
                curve = r["methods"][m]["tuned"]["position_curve"]
                axes[2].plot(np.linspace(0, 8, len(curve)), curve, color=f"C{m_i}", label=m)
    axes[0].set_xticks(x, METHODS, rotation=20)
    axes[0].set_yscale("log")
    labels(axes[0], "", "needle perplexity at 4W (held out)", "needle perplexity, zero-shot and fine-tuned")
    labels(axes[1], "length / W", "passkey accuracy", "passkey after fine-tuning (solid seed 0, dashed seed 1)")
    axes[2].axvline(1, color="grey", lw=0.8)
    axes[2].axvline(4, color="grey", lw=0.8, ls=":")
    labels(axes[2], "position / W", "loss", f"loss by position after fine-tuning (seed {results[0]['seed']})")
    fig.suptitle(f"RoPE methods from W = {w} to 4W: one base, the same fine-tune")
    save(fig, path)


def table(results: list[dict], w: int) -> str:
    head = (f"{'seed':>4} {'method':>12} {'when':>9} {'needle ppl':>11} {'short loss':>10}  "
            "passkey W/4W/8W   NIAH W/4W/8W")
    lines = [head]
    for r in results:
        for m in METHODS:
            for when in ("zero_shot", "tuned"):
                row = r["methods"][m][when]
                pk = "/".join(f"{row[f'passkey_{n * w}']:.2f}" for n in (1, 4, 8))
                ni = "/".join(f"{row[f'niah_single_noise_{n * w}']:.2f}" for n in (1, 4, 8))
                lines.append(f"{r['seed']:>4} {m:>12} {when:>9} {row['needle_ppl']:>11.2f} {row['short_loss']:>10.4f}  "
                             f"{pk:>15}  {ni:>14}")
        lines.append("     targets: " + "; ".join(f"{k} {'met' if v['met'] else 'missed'} ({v['longrope2']:.4g} vs "
                                                  f"{v['best_baseline']:.4g})" for k, v in r["targets"].items()))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=Path, default=Path("data/tokens"), help="a tokenize stage's output")
    ap.add_argument("--long", type=Path, default=Path("data/packed/stage2/val"),
                    help="packed validation documents of >= 8W tokens (needles, loss by position, short text)")
    ap.add_argument("--packed", type=Path, default=Path("data/packed"))
    ap.add_argument("--text", nargs="+", default=["docstrings", "modules"], help="domains of real short text")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--base", nargs="*", default=[], metavar="FIELD=VALUE", help="the base's Variant fields")
    ap.add_argument("--tune", nargs="*", default=[], metavar="FIELD=VALUE", help="the fine-tune's Variant fields")
    ap.add_argument("--chars-per-token", type=float, default=3.0, help="sizes the fine-tune's longest documents")
    ap.add_argument("--search", nargs="*", default=[], metavar="FIELD=VALUE", help="rope_search params")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per task and length")
    ap.add_argument("--out", type=Path, default=Path("bench/results/rope-methods"),
                   help="folder of the JSON (<benchmark>-<device>-<date>.json)")
    ap.add_argument("--merge", type=Path, nargs="+", metavar="JSON",
                    help="results of the same settings, one seed each (processes run side by side): one JSON, "
                         "figure and table of them all in --out")
    args = ap.parse_args()
    if args.merge:
        return merge(args.merge, args.out)
    try:
        args.base = dataclasses.replace(BASE, **variant_fields(args.base))
        args.tune = TUNE | variant_fields(args.tune)
    except ValueError as e:
        ap.error(f"--base / --tune: {e}")
    search = {"population": 16, "generations": 8, "sequences": 4, "table_sequences": 16}
    try:  # (pydantic reads "8" as 8 and names an unknown or bad field)
        args.search = RopeSearchParams(**search | dict(kv.split("=", 1) for kv in args.search))
    except ValueError as e:
        raise SystemExit(f"--search: {e}") from None
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tok = TextTokenizer.load(args.tokens / "tokenizer")
    readers = [ShardReader(args.tokens / d) for d in args.text]
    long = PackedDataset(args.long)
    w = args.base.seq_len
    fields = {"window": w, "base": dataclasses.asdict(args.base), "tune": args.tune,
              "chars_per_token": args.chars_per_token, "search": args.search.model_dump(), "prompts": args.prompts}
    device_name = None if torch.cuda.is_available() else "cpu"
    results: list[dict] = []
    partial_file: Path | None = None

    def partial(seed_so_far: dict) -> None:  # a run stopped by its time limit keeps what it measured
        nonlocal partial_file  # (named by its seeds: processes running one seed each may share --out)
        name = "rope_methods-partial-seed" + "-".join(map(str, args.seeds))
        partial_file = write_result(args.out, name, fields | {"results": results + [seed_so_far]}, device_name,
                                    quiet=True)

    for seed in args.seeds:
        results.append(one_seed(seed, args, tok, readers, long, device, partial))
    print(table(results, w))
    name = "rope_methods" + ("" if len(args.seeds) > 1 else f"-seed{args.seeds[0]}")  # (one a seed: --merge)
    path = write_result(args.out, name, fields | {"results": results}, device_name)
    plot(results, w, path.with_suffix(".png"))
    if partial_file is not None:
        partial_file.unlink()


SAME = ("device", "window", "base", "tune", "chars_per_token", "search", "prompts")
"""What results must share to be merged: the model, the recipe and the scoring."""


def merge(files: list[Path], out: Path) -> None:
    """One result of several runs' seeds, checked to come from the same settings."""
    if out is None:
        raise SystemExit("--merge: give --out, the folder of the merged JSON and figure")
    runs = []
    for f in files:
        try:
            runs.append(json.loads(f.read_text()))
        except (OSError, ValueError) as e:
            raise SystemExit(f"--merge: {f}: {e}") from None
    for f, r in zip(files[1:], runs[1:], strict=True):
        differ = [k for k in SAME if r.get(k) != runs[0].get(k)]
        if differ:
            raise SystemExit(f"--merge: {f} differs from {files[0]} in {', '.join(differ)}: not the same bench")
    for f, r in zip(files, runs, strict=True):
        for seed in r.get("results", []):
            missing = [m for m in METHODS if m not in seed.get("methods", {})] + (["targets"] * ("targets" not in seed))
            if missing:
                raise SystemExit(f"--merge: {f}: seed {seed.get('seed')} lacks {', '.join(missing)} (a partial "
                                 "result, or one from an older version of this bench)")
    results = sorted((s for r in runs for s in r["results"]), key=lambda s: s["seed"])
    seeds = [s["seed"] for s in results]
    if len(set(seeds)) < len(seeds):
        raise SystemExit(f"--merge: seed(s) {sorted({s for s in seeds if seeds.count(s) > 1})} in more than one file")
    first = runs[0]
    w = first["window"]
    print(table(results, w))
    fields = {k: first[k] for k in SAME if k != "device"} | {"merged_from": [f.name for f in files], "results": results}
    path = write_result(out, "rope_methods", fields, first["device"])
    plot(results, w, path.with_suffix(".png"))


if __name__ == "__main__":
    main()
