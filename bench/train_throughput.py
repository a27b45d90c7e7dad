"""Training throughput on one GPU (docs/training-speed.md): full optimizer steps as
the training stages run them (the loop's own `prepare` and `train_step`: bf16 compute copies over
fp32 masters, fused AdamW, the chunked loss, compiled blocks), eager beside compiled, for the 125M
and 760M shapes, Llama-style, FoX (Pro) and FoX (Pro) with ACP (forget gates at their
initialisation), at 16K tokens (one document) and at 64K; MFU over the datasheet peak (989 TFLOP/s)
and over the bf16 matmul rate measured on these GPUs (790); the FoX/Transformer ratios (FoX paper
Table 6: 27k / 38k = 0.71 on 4 x L40S); and with --profile, where one step's GPU time goes and
where the GPU waited. Steps are timed as the loop runs them (each read after the next is queued),
beside isolated steps (the device drained before and after each).

    python bench/train_throughput.py      # on a CUDA machine

With --workspace, the other way round: each training stage of a workspace the pipeline ran in, timed
here with its own model, loop settings and packed data, beside the tokens/s its run logged (issue 32:
the pipeline runs at the fast path's speed).

    python bench/train_throughput.py --workspace <ws>
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
from collections.abc import Iterator
from pathlib import Path

import torch

from longctx import config
from longctx.data.loader import training_data
from longctx.io import read_json
from longctx.model.attention import resolve
from longctx.perf import measure, one_document, prepared, prepared_as, profile, write_result
from longctx.train.batches import step_batches
from longctx.train.models import preset
from longctx.train.parallel import Parallel, with_sequence_parallel

MODELS = {"Transformer": ("llama", False), "FoX (Pro)": ("fox", False), "FoX (Pro) + ACP": ("fox", True)}
# (shape, tokens, activation checkpointing, compile settings)
SETTINGS = [("fox-125m", 16384, "none", (False, True)), ("fox-760m", 16384, "none", (False, True)),
            ("fox-125m", 65536, "none", (True,)), ("fox-760m", 65536, "full", (True,))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("bench/results/train-throughput"),
                   help="folder of the JSON (<benchmark>-<device>-<date>.json)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="add one profiled step's GPU time by kernel kind")
    ap.add_argument("--only", nargs="*", help="shapes to run (default all)")
    ap.add_argument("--tokens", nargs="*", type=int, help="sequence lengths to run (default all)")
    ap.add_argument("--models", nargs="*", choices=list(MODELS), help="models to run (default all)")
    ap.add_argument("--modes", nargs="*", default=["eager", "compiled"], choices=["eager", "compiled"],
                    help="eager, compiled or both (where the setting has both)")
    ap.add_argument("--step-end", nargs="*", default=["device"], choices=["device", "host"],
                    help="where a step checks the loss and clips: on the device (fused AdamW skips a bad "
                         "update) or on the host (LONGCTX_STEP_END=host); both to time them side by side")
    ap.add_argument("--workspace", type=Path, help="time the training stages of this pipeline workspace")
    args = ap.parse_args()
    if args.workspace:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
        rows = []
        for row in stage_rows(args.workspace, args.steps, Parallel(device=device)):
            rows.append(row)  # written as they come: a run cut short keeps them
            write_result(args.out, "train_throughput_stages", {"workspace": str(args.workspace), "rows": rows}, name,
                         quiet=True)
        print_stages(rows, name)
        return
    par = Parallel(device=torch.device("cuda"))
    rows = []
    for shape, tokens, recompute, compiles in SETTINGS:
        if (args.only and shape not in args.only) or (args.tokens and tokens not in args.tokens):
            continue
        for (name, (arch, acp)), compile, end in itertools.product(MODELS.items(), compiles, args.step_end):
            if (args.models and name not in args.models) or ("compiled" if compile else "eager") not in args.modes:
                continue
            os.environ["LONGCTX_STEP_END"] = end
            cfg = preset(shape, arch, tokens)
            row = {"shape": shape.removeprefix("fox-"), "model": name, "tokens": tokens, "compile": compile,
                   "step_end": end, "recompute": recompute, "attention": resolve("auto", par.device, arch == "fox")}
            try:
                run = prepared(cfg, par, compile=compile, recompute=recompute, acp=acp)
                batch = one_document(tokens, cfg.vocab_size, par.device)
                row.update(measure(run, lambda i, batch=batch: [batch], args.steps))
                if args.profile and tokens == 16384:
                    row["profile"] = profile(run, [batch])
            except torch.OutOfMemoryError:
                row["error"] = "out of memory"
            rows.append(row)
            print({k: v for k, v in row.items() if k not in ("profile", "losses")}, flush=True)
            write_result(args.out, "train_throughput", {"rows": rows}, quiet=True)  # a cut-short run keeps these
            run = None
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    ratios = {}
    for r in rows:
        if r["model"] != "Transformer" and "tokens_per_s_per_gpu" in r:
            base = next((t for t in rows if t["model"] == "Transformer" and "tokens_per_s_per_gpu" in t and
                         all(t[k] == r[k] for k in ("shape", "tokens", "compile", "step_end"))), None)
            if base:
                key = f"{r['shape']} {r['tokens'] // 1024}K {'compiled' if r['compile'] else 'eager'} {r['model']}"
                key += "" if r["step_end"] == "device" else " (host checks)"
                ratios[key] = round(r["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"], 3)
    print(f"\ntraining steps, bf16 over fp32 masters, AdamW, one document ({torch.cuda.get_device_name()})")
    print(f"{'shape':<5} {'model':<16} {'tokens':>6} {'mode':<14} {'attention':<9} {'ms/step':>8} {'isolated':>8} "
          f"{'tokens/s':>9} {'MFU':>6} {'MFU/790':>7} {'dense TF/s':>10} {'GiB':>6} {'1st s':>6} {'graphs':>6}")
    for r in rows:
        mode = "compiled" if r["compile"] else "eager"
        mode += "" if r["recompute"] == "none" else f"+{r['recompute'][0]}AC"
        mode += "" if r["step_end"] == "device" else "/host"
        if "error" in r:
            print(f"{r['shape']:<5} {r['model']:<16} {r['tokens']:>6} {mode:<14} {r['attention']:<9} {r['error']}")
            continue
        print(f"{r['shape']:<5} {r['model']:<16} {r['tokens']:>6} {mode:<14} {r['attention']:<9} "
              f"{r['step_s'] * 1e3:>8.1f} {r['isolated_step_s'] * 1e3:>8.1f} {r['tokens_per_s_per_gpu']:>9.0f} "
              f"{r.get('mfu', '-'):>6} "
              f"{r.get('mfu_matmul_ceiling', '-'):>7} {r.get('dense_equivalent_tflops', '-'):>10} "
              f"{r.get('peak_memory_gib', '-'):>6} {r['first_step_s']:>6} "
              f"{r['graphs_compiled']:>6}")
    for r in rows:
        if "profile" in r:
            p = r["profile"]
            print(f"{r['shape']} {r['model']} {'compiled' if r['compile'] else 'eager'}: step {p['wall_ms']} ms, "
                  f"kernels {p['kernel_ms']} ms: {p['by_kind_ms']}; syncs {p['syncs']}; "
                  f"graph breaks {r['graph_breaks']}; GPU idle {p['idle_ms']} ms between {p['kernels']} kernels, "
                  f"{p['idle_in_long_gaps_ms']} ms of it in {p['long_gaps']} gaps over 20 us: {p['longest_gaps'][:4]}")
    print(f"FoX/Transformer tokens/s: {ratios} (FoX paper Table 6: 0.71)")
    write_result(args.out, "train_throughput", {"rows": rows, "fox_over_transformer": ratios})


def stage_rows(ws: Path, steps: int, par: Parallel) -> Iterator[dict]:
    """Each training stage that ran in `ws`: `steps` optimizer steps of its model, loop settings and
    data (the steps spread over its run, curriculum phases included), timed as `measure` times them,
    beside the tokens/s its run achieved (wall clock after its first steps, checkpoints included;
    and the median of its steps' own timers). The first step timed is the stage's own first step
    from the same initial weights (a base stage's), so its loss is the log's first."""
    cfg = config.load(ws / "params.yaml")
    vocab = int(read_json(ws / "data" / "tokens" / "index.json", "token index")["vocab_size"])
    stages = {"base": cfg.train.base, **{f"pretrain_stage{i + 1}": s for i, s in enumerate(cfg.train.pretrain.stages)},
              "sft": cfg.train.sft}
    for name, stage in stages.items():
        logs = sorted((ws / "runs" / name).glob("*/metrics.jsonl"), key=lambda f: f.stat().st_mtime)
        if stage is None or not logs:
            continue
        logged = [json.loads(line) for line in logs[-1].read_text().splitlines()]
        data = training_data(ws / "data" / "packed", stage)
        window = max(d.seq_len for d in getattr(data, "parts", [data]))
        model = cfg.model.as_model_config(vocab)
        model = model.model_copy(update={"max_position_embeddings": max(window, model.max_position_embeddings)})
        spar = with_sequence_parallel(par, stage.sequence_parallel, model.n_heads)
        run = prepared_as(model, spar, stage, cfg.model.attention_backend)
        stride = max(1, stage.steps // (2 + 2 * steps))
        row = {"stage": name, "split": stage.split, "window": window, "micro_batch": stage.micro_batch,
               "compile": stage.compile and par.device.type == "cuda", "recompute": stage.activation_checkpointing,
               "acp": stage.acp_eps is not None, "steps_spaced_by": stride,
               "stage_first_loss": logged[0]["loss"],
               "stage_tokens_per_s": wall_rate(logged[2:] if len(logged) > 3 else logged),
               "stage_step_tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in logged[3:] or logged), 1)}
        row |= measure(run, lambda i, data=data, stage=stage, spar=spar, stride=stride:
                       step_batches(data, i * stride % stage.steps, stage, spar)[1], steps)
        row["stage_over_bench"] = round(row["stage_tokens_per_s"] / row["tokens_per_s_per_gpu"], 3)
        print({k: v for k, v in row.items() if k != "losses"}, flush=True)
        run = None
        if par.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        yield row


def wall_rate(rows: list[dict]) -> float:
    """Tokens per wall-clock second between logged steps (a resumed run's clock starts again); NaN
    for a run of one step."""
    pairs = [(b["tokens"], b["wall_s"] - a["wall_s"]) for a, b in itertools.pairwise(rows) if b["wall_s"] > a["wall_s"]]
    return round(sum(t for t, _ in pairs) / sum(s for _, s in pairs), 1) if pairs else float("nan")


def print_stages(rows: list[dict], device: str) -> None:
    print(f"\nthe pipeline's training stages against the same steps timed here ({device})")
    print(f"{'stage':<16} {'window':>6} {'micro':>5} {'mode':<9} {'bench tok/s':>11} {'stage tok/s':>11} "
          f"{'stage/bench':>11} {'steps alone':>11} {'MFU':>6}")
    for r in rows:
        mode = ("compiled" if r["compile"] else "eager") + ("" if r["recompute"] == "none" else "+AC")
        print(f"{r['stage']:<16} {r['window']:>6} {r['micro_batch']:>5} {mode:<9} {r['tokens_per_s_per_gpu']:>11,.0f} "
              f"{r['stage_tokens_per_s']:>11,.0f} {r['stage_over_bench']:>11.3f} "
              f"{r['stage_step_tokens_per_s']:>11,.0f} {r.get('mfu', '-'):>6}")


if __name__ == "__main__":
    main()
