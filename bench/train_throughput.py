"""Training throughput on one GPU (work log: bench/training_speed_notes.md): full optimizer steps as
the training stages run them (the loop's own `prepare` and `train_step`: bf16 compute copies over
fp32 masters, fused AdamW, the chunked loss, compiled blocks), eager beside compiled, for the 125M
and 760M shapes, Llama-style, FoX (Pro) and FoX (Pro) with ACP (forget gates at their
initialisation), at 16K tokens (one document) and at 64K; MFU over the datasheet peak (989 TFLOP/s)
and over the bf16 matmul rate measured on these GPUs (790); the FoX/Transformer ratios (FoX paper
Table 6: 27k / 38k = 0.71 on 4 x L40S); and with --profile, where one step's GPU time goes and
where the GPU waited. Steps are timed as the loop runs them (each read after the next is queued),
beside isolated steps (the device drained before and after each).

    python bench/train_throughput.py --out bench/results      # on a CUDA machine
"""

from __future__ import annotations

import argparse
import itertools
import os
from pathlib import Path

import torch

from longctx.model.attention import resolve
from longctx.perf import measure, one_document, prepared, profile, write_result
from longctx.train.models import preset
from longctx.train.parallel import Parallel

MODELS = {"Transformer": ("llama", False), "FoX (Pro)": ("fox", False), "FoX (Pro) + ACP": ("fox", True)}
# (shape, tokens, activation checkpointing, compile settings)
SETTINGS = [("fox-125m", 16384, "none", (False, True)), ("fox-760m", 16384, "none", (False, True)),
            ("fox-125m", 65536, "none", (True,)), ("fox-760m", 65536, "full", (True,))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
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
    args = ap.parse_args()
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
          f"{'tokens/s':>9} {'MFU':>6} {'MFU/790':>7} {'GiB':>6} {'1st s':>6} {'graphs':>6}")
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
              f"{r.get('mfu_matmul_ceiling', '-'):>7} {r.get('peak_memory_gib', '-'):>6} {r['first_step_s']:>6} "
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


if __name__ == "__main__":
    main()
