"""Training-step cost of the model core per attention backend on one GPU: full
optimizer steps of the 125M shape (12 x 768, heads of 64) as the training stages run them
(compiled blocks, FSDP2 bf16 over fp32), Llama-style (RoPE) and FoX (Pro), at 4K and 16K tokens
(one document), for every backend that runs each; and the peak memory of a 64K-token step with
the chunked loss against the plain one (full logits).

    python bench/model_step.py      # on a CUDA machine
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from longctx.model import attention
from longctx.model.loss import IGNORE, chunked_cross_entropy
from longctx.perf import measure, one_document, prepared, write_result
from longctx.train.models import build, preset
from longctx.train.parallel import Parallel


def loss_memory(chunked: bool, tokens: int) -> float:
    """Peak GiB of forward + backward of the 125M shape (bf16 weights) with either loss."""
    model = build(preset("fox-125m", "llama", tokens), device="cuda").to(torch.bfloat16)
    b = one_document(tokens, model.cfg.vocab_size, torch.device("cuda"))
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    hidden = model.hidden(b.ids, b.cu_seqlens)
    if chunked:
        loss = chunked_cross_entropy(hidden, model.lm_head.weight, b.labels)
    else:
        loss = F.cross_entropy(model.lm_head(hidden).float(), b.labels, ignore_index=IGNORE, reduction="sum")
    loss.backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("bench/results/model-step"),
                   help="folder of the JSON (<benchmark>-<device>-<date>.json)")
    args = ap.parse_args()
    par = Parallel(device=torch.device("cuda"))
    rows = []
    for arch in ("llama", "fox"):
        for backend in attention.available(par.device):
            if backend == "reference" or (arch == "fox" and backend in attention.PLAIN_ONLY):
                continue
            for tokens in (4096, 16384):
                row = {"model": arch, "backend": backend, "tokens": tokens}
                try:
                    run = prepared(preset("fox-125m", arch, tokens), par, compile=True, backend=backend)
                    batch = one_document(tokens, run.model.cfg.vocab_size, par.device)
                    row.update(measure(run, lambda i, batch=batch: [batch], steps=5 if tokens > 4096 else 10))
                except Exception as e:  # a backend that cannot run this shape is reported, not hidden
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                run = None
                torch.cuda.empty_cache()
                rows.append(row)
                print(row, flush=True)
    memory = {}
    for chunked in (True, False):
        try:
            memory["chunked" if chunked else "plain"] = round(loss_memory(chunked, 65536), 2)
        except torch.OutOfMemoryError:
            memory["chunked" if chunked else "plain"] = "out of memory"
        torch.cuda.empty_cache()
    print(f"\n125M shape, optimizer steps, compiled, one document ({torch.cuda.get_device_name()})")
    print(f"{'model':<6} {'backend':<11} {'tokens':>7} {'ms':>9} {'tokens/s':>10}")
    for r in rows:
        ms = f"{r['step_s'] * 1e3:.1f}" if "step_s" in r else "-"
        rate = r.get("tokens_per_s_per_gpu", r.get("error", ""))
        print(f"{r['model']:<6} {r['backend']:<11} {r['tokens']:>7} {ms:>9} {rate:>10}")
    print(f"peak memory of a 64K-token step: chunked loss {memory['chunked']} GiB, plain loss {memory['plain']} GiB")
    write_result(args.out, "model_step", {"rows": rows, "peak_memory_gib_64k": memory})


if __name__ == "__main__":
    main()
