"""Training-step cost of the model core on one GPU (issue 3).

1. Forward+backward tokens/s of the 125M shape (12 x 768, heads of 64), as a Llama-style
   Transformer (RoPE) and as FoX (Pro), at 4K and 16K tokens (one document), for every
   attention backend that runs here. bf16 weights, chunked loss.
2. Peak GPU memory of one 64K-token training step with the chunked loss against the plain one
   (full logits), same model.

    python bench/model_step.py --out bench/results      # on a CUDA machine
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import write_result  # noqa: E402

from longctx.model import attention  # noqa: E402
from longctx.model.config import PRESETS, FoxConfig, ModelConfig  # noqa: E402
from longctx.model.loss import chunked_cross_entropy, shift_labels  # noqa: E402
from longctx.model.config import RopeConfig  # noqa: E402
from longctx.model.transformer import Transformer  # noqa: E402


def model_for(kind: str, backend: str) -> Transformer:
    shape = dict(PRESETS["fox-125m"], max_position_embeddings=65536)
    if kind == "fox":
        cfg = ModelConfig(**shape, rope=None, fox=FoxConfig())
    else:
        cfg = ModelConfig(**shape, rope=RopeConfig(theta=500000.0))
    torch.manual_seed(0)
    return Transformer(cfg, attention_backend=backend).cuda().to(torch.bfloat16)


def step(model: Transformer, ids: torch.Tensor, cu: torch.Tensor, chunked: bool) -> None:
    labels = shift_labels(ids, cu)
    hidden = model.hidden(ids, cu)
    if chunked:
        loss = chunked_cross_entropy(hidden, model.lm_head.weight, labels) / labels.numel()
    else:
        loss = F.cross_entropy(model.lm_head(hidden).float(), labels, ignore_index=-100)
    loss.backward()


def timed(model: Transformer, tokens: int, iters: int) -> float:
    ids = torch.randint(0, model.cfg.vocab_size, (tokens,), device="cuda")
    cu = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
    for _ in range(2):
        step(model, ids, cu, chunked=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        step(model, ids, cu, chunked=True)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def peak_memory(chunked: bool, tokens: int) -> float:
    model = model_for("llama", "auto")
    ids = torch.randint(0, model.cfg.vocab_size, (tokens,), device="cuda")
    cu = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    step(model, ids, cu, chunked)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**30
    del model
    torch.cuda.empty_cache()
    return peak


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    dev = torch.device("cuda")
    rows = []
    for kind in ("llama", "fox"):
        for backend in attention.available(dev):
            if backend == "reference" or (kind == "fox" and backend in ("flash_attn", "varlen")):
                continue
            for tokens in (4096, 16384):
                model = model_for(kind, backend)
                try:
                    sec = timed(model, tokens, iters=5 if tokens > 4096 else 10)
                    rows.append({"model": kind, "backend": backend, "tokens": tokens, "ms": round(sec * 1e3, 2),
                                 "tokens_per_s": round(tokens / sec)})
                except Exception as e:  # a backend that cannot run this shape is reported, not hidden
                    rows.append({"model": kind, "backend": backend, "tokens": tokens, "error": f"{type(e).__name__}: {e}"[:300]})
                del model
                torch.cuda.empty_cache()
                print(rows[-1], flush=True)
    memory = {}
    for chunked in (True, False):
        try:
            memory["chunked" if chunked else "plain"] = round(peak_memory(chunked, 65536), 2)
        except torch.OutOfMemoryError:
            memory["chunked" if chunked else "plain"] = "out of memory"
    print(f"\n125M shape, fwd+bwd, bf16, one document, chunked loss ({torch.cuda.get_device_name()})")
    print(f"{'model':<6} {'backend':<11} {'tokens':>7} {'ms':>9} {'tokens/s':>10}")
    for r in rows:
        print(f"{r['model']:<6} {r['backend']:<11} {r['tokens']:>7} {r.get('ms', '-'):>9} "
              f"{r.get('tokens_per_s', r.get('error', '')):>10}")
    print(f"peak memory of a 64K-token step: chunked loss {memory['chunked']} GiB, plain loss {memory['plain']} GiB")
    write_result(args.out, "model_step", {"rows": rows, "peak_memory_gib_64k": memory})


if __name__ == "__main__":
    main()
