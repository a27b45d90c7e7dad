"""Greedy decoding speed on one GPU (docs/kernel.md): the model's own KV-cache path
(`model/decode.py`: the prompt through the attention backend, then one token at a time) at 16K
and 64K tokens of context, Transformer beside FoX (Pro), 125M and 760M shapes, bf16, random
weights (speed does not depend on them). Each new token attends through the Triton decode kernel
(fox/decode.py), and through the plain PyTorch path beside it (LONGCTX_DECODE=math) with --modes.
Reports prefill ms, decode tokens/s and FoX / Transformer ratios.

    python bench/decode.py      # on a CUDA machine
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

import torch

from longctx.model import decode
from longctx.perf import write_result
from longctx.train.models import build, preset

MODELS = {"Transformer": "llama", "FoX (Pro)": "fox"}


def timed_decode(model, context: int, steps: int) -> dict:
    """Prefill `context` random tokens, then `steps` single-token steps (the first two not timed)."""
    tokens = torch.randint(0, model.cfg.vocab_size, (context,), device="cuda",
                           generator=torch.Generator(device="cuda").manual_seed(0))
    cache = decode.Cache(model.cfg.n_layers)
    torch.cuda.synchronize()
    begin = time.perf_counter()
    logits = model(tokens, cache=cache)
    torch.cuda.synchronize()
    prefill = time.perf_counter() - begin
    nxt = logits[-1:].argmax(-1)
    for i in range(steps + 2):
        if i == 2:
            torch.cuda.synchronize()
            begin = time.perf_counter()
        nxt = model(nxt, cache=cache)[-1:].argmax(-1)
    torch.cuda.synchronize()
    per_token = (time.perf_counter() - begin) / steps
    return {"prefill_ms": prefill * 1e3, "ms_per_token": per_token * 1e3, "decode_tokens_per_s": 1 / per_token,
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["fox-125m", "fox-760m"])
    ap.add_argument("--contexts", nargs="+", type=int, default=[16384, 65536])
    ap.add_argument("--modes", nargs="+", default=["kernel", "math"], choices=["kernel", "math"])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--out", type=Path, default=Path("bench/results/decode"),
                   help="folder of the JSON (<benchmark>-<device>-<date>.json)")
    args = ap.parse_args()
    rows = []
    with torch.no_grad():
        for shape, (name, arch) in itertools.product(args.shapes, MODELS.items()):
            model = build(preset(shape, arch, max(args.contexts)), device="cuda").to(torch.bfloat16).eval()
            for context, mode in itertools.product(args.contexts, args.modes):
                decode.KERNEL = mode == "kernel"
                torch.cuda.reset_peak_memory_stats()
                row = {"shape": shape.removeprefix("fox-"), "model": name, "context": context, "decode": mode,
                       **timed_decode(model, context, args.steps)}
                rows.append(row)
                print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
            del model
            torch.cuda.empty_cache()
    ratios = {}
    print(f"{'shape':<5} {'model':<12} {'context':>7} {'decode':<6} {'prefill ms':>10} {'ms/token':>8} {'tokens/s':>8}")
    for r in rows:
        print(f"{r['shape']:<5} {r['model']:<12} {r['context']:>7} {r['decode']:<6} {r['prefill_ms']:>10.1f} "
              f"{r['ms_per_token']:>8.2f} {r['decode_tokens_per_s']:>8.1f}")
        if r["model"] != "Transformer":
            peer = next(p for p in rows if p["model"] == "Transformer" and
                        all(p[k] == r[k] for k in ("shape", "context", "decode")))
            key = f"{r['shape']} {r['context']} {r['decode']}"
            ratios[key] = r["decode_tokens_per_s"] / peer["decode_tokens_per_s"]
    print(f"FoX (Pro) / Transformer decode tokens/s: { {k: round(v, 3) for k, v in ratios.items()} }")
    write_result(args.out, "decode", {"rows": rows, "fox_over_transformer": ratios})


if __name__ == "__main__":
    main()
