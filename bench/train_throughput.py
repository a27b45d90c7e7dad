"""Training throughput on one GPU (issue 4): tokens/s and MFU of full optimizer steps (bf16
autocast over fp32 weights, AdamW, chunked loss, as the training stages run) for the 125M and
760M shapes, Llama-style, FoX (Pro) with the default attention backend (the Triton `fox` kernel
on CUDA) and FoX (Pro) with ACP (forget gates at their initialisation), at 16K tokens; the
FoX/Transformer ratio (FoX paper Table 6: 27k / 38k = 0.71 on 4 x L40S); and the longest
single-document step the 760M shape fits with activation checkpointing.

    python bench/train_throughput.py --out bench/results      # on a CUDA machine
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import write_result  # noqa: E402

from longctx.model import attention  # noqa: E402
from longctx.model.attention import Acp  # noqa: E402
from longctx.model.config import PRESETS, FoxConfig, ModelConfig, RopeConfig  # noqa: E402
from longctx.model.loss import shift_labels  # noqa: E402
from longctx.model.transformer import Transformer  # noqa: E402
from longctx.train.loop import Batch, _peak_flops, flop_params, step_flops  # noqa: E402
from longctx.train.optim import adamw  # noqa: E402


def model_backend(model: Transformer) -> str:
    return attention.select(model.attention_backend, torch.device("cuda"), model.cfg.fox is not None).__name__


def build(shape: str, fox: bool, window: int) -> Transformer:
    dims = dict(PRESETS[shape], max_position_embeddings=window)
    cfg = ModelConfig(**dims, rope=None, fox=FoxConfig()) if fox else ModelConfig(**dims, rope=RopeConfig(theta=5e5))
    torch.manual_seed(0)
    return Transformer(cfg).cuda()


def run_steps(model: Transformer, tokens: int, steps: int, checkpointing: bool) -> tuple[float, Batch]:
    model.checkpoint_layers = checkpointing
    opt = adamw(model, 1e-4, (0.9, 0.95), 0.1)
    ids = torch.randint(0, model.cfg.vocab_size, (tokens,), device="cuda")
    cu = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
    batch = Batch(ids, cu, shift_labels(ids, cu), [0])
    times = []
    for i in range(steps + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids, cu, labels=batch.labels) / tokens
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2], batch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--max-tokens", type=int, default=131072,
                        help="longest step to try for the 760M shape (each doubling costs ~4x the time)")
    args = parser.parse_args()
    peak = _peak_flops(torch.device("cuda"))
    rows = []
    for shape in ("fox-125m", "fox-760m"):
        for name in ("Transformer", "FoX (Pro)", "FoX (Pro) + ACP"):
            model = build(shape, name != "Transformer", 16384)
            model.acp = Acp() if name.endswith("ACP") else None
            sec, batch = run_steps(model, 16384, 5, checkpointing=False)
            flops = step_flops(model.cfg, flop_params(model), batch)
            rows.append({"shape": shape.removeprefix("fox-"), "model": name, "attention": model_backend(model),
                         "tokens": 16384, "step_ms": round(sec * 1e3, 1), "tokens_per_s": round(16384 / sec),
                         "mfu": round(flops / sec / peak, 4) if peak else None,
                         "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)})
            if model.acp is not None:
                rows[-1]["acp_pruned_fraction"] = round(model.acp.stats.pruned_fraction(), 4)
            print(rows[-1], flush=True)
            del model
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    ratios = {}
    for shape in ("125m", "760m"):
        t = next(r for r in rows if r["shape"] == shape and r["model"] == "Transformer")
        for name in ("FoX (Pro)", "FoX (Pro) + ACP"):
            f = next(r for r in rows if r["shape"] == shape and r["model"] == name)
            ratios[f"{shape} {name}"] = round(f["tokens_per_s"] / t["tokens_per_s"], 3)
    longest = {}
    model = build("fox-760m", False, 1 << 20)
    for tokens in (t for t in (32768, 65536, 131072, 262144, 524288) if t <= args.max_tokens):
        try:
            run_steps(model, tokens, 1, checkpointing=True)
            longest = {"tokens": tokens, "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}
            print("fits", longest, flush=True)
        except torch.OutOfMemoryError:
            break
        finally:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    print(f"\ntraining steps at 16K tokens, bf16 autocast, AdamW ({torch.cuda.get_device_name()})")
    print(f"{'shape':<6} {'model':<16} {'ms/step':>9} {'tokens/s':>9} {'MFU':>7} {'peak GiB':>9}")
    for r in rows:
        print(f"{r['shape']:<6} {r['model']:<16} {r['step_ms']:>9} {r['tokens_per_s']:>9} {r['mfu'] or '-':>7} "
              f"{r['peak_memory_gib']:>9}")
    print(f"FoX/Transformer tokens/s: {ratios} (FoX paper Table 6: 0.71)")
    print(f"longest 760M single-document step with activation checkpointing: {longest}")
    write_result(args.out, "train_throughput",
                 {"rows": rows, "fox_over_transformer": ratios, "longest_760m_step": longest})


if __name__ == "__main__":
    main()
