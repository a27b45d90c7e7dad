"""Attention backends checked where training lives (issue 32): one training step of a trained
checkpoint on a batch of its own packed split (many documents per sequence), bf16 autocast as the
stages run it, with each document-masked backend against sdpa's: the loss and every parameter's
gradient cosine. On the gpu-64k base (H100, 2026-11-26) the cuDNN path's q/k gradients were
uncorrelated with sdpa's: sdpa ran first, on PyTorch's own cuDNN path, and the wrapper then ran the
graphs it had cached (cudnn_attention._private keeps them apart now; bench/cudnn_grads.py).

    python bench/backend_grads.py --workspace /tmp/longctx-ws-llama --out bench/results
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from longctx import config
from longctx.data.loader import PackedDataset
from longctx.model import cudnn_attention
from longctx.perf import write_result
from longctx.train.batches import make_batch
from longctx.train.loop import autocast, prepare
from longctx.train.models import load_model
from longctx.train.parallel import Parallel

DEV = torch.device("cuda")
# name: (backend, documents that take cuDNN's dense kernel: at least this many tokens; None: the model's rule)
VARIANTS = {"sdpa": ("sdpa", None), "varlen": ("varlen", None), "cudnn": ("cudnn", None),
            "cudnn_dense_only": ("cudnn", 1), "cudnn_fa2_only": ("cudnn", 1 << 30)}


def step(workspace: Path, name: str, split: str, samples: list[int]) -> tuple[float, dict[str, torch.Tensor]]:
    backend, long_doc = VARIANTS[name]
    with cudnn_attention.fixed_long_doc(long_doc):
        run = config.resolve({"profile": "gpu-64k"}).train.base.model_copy(update={"compile": False})
        model = prepare(load_model(workspace / "models" / "base", backend).to(DEV), run, Parallel(device=DEV))
        batch = make_batch(PackedDataset(workspace / "data" / "packed" / split / "train"), samples, DEV)
        with autocast(model, DEV):
            loss = model(batch.ids, batch.cu_seqlens.tolist(), labels=batch.labels,
                         loss_chunk=run.loss_chunk) / batch.valid
            loss.backward()
        return float(loss.detach()), {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workspace", type=Path, required=True, help="a finished gpu-64k run (models/base, data/)")
    ap.add_argument("--split", default="base")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    losses, grads = {}, {}
    for name in VARIANTS:
        losses[name], grads[name] = step(args.workspace, name, args.split, [0, 1, 2, 3])
        torch.cuda.empty_cache()
    rows = {}
    for name in list(VARIANTS)[1:]:
        cos = {n: F.cosine_similarity(g.flatten(), grads["sdpa"][n].flatten(), dim=0, eps=1e-30).item()
               for n, g in grads[name].items()}
        worst = min(cos, key=cos.get)
        rows[name] = {"loss": losses[name], "min_cosine": cos[worst], "worst_param": worst, "cosines": cos}
        print(f"{name:<18} loss {losses[name]:.5f} (sdpa {losses['sdpa']:.5f})  lowest gradient cosine "
              f"{cos[worst]:+.4f} ({worst})", flush=True)
    write_result(args.out, "backend_grads", {"split": args.split, "sdpa_loss": losses["sdpa"], "variants": rows})


if __name__ == "__main__":
    main()
