"""A FoX (Pro) model trained by the project's own loop on a packed split: the trained forget
gates `bench/attention.py --gates-from` times the kernel and ACP with. The training loop is the
stages' (`train.loop.train`: bf16 copies over fp32 masters, compiled blocks on CUDA), without
MLflow, so it also runs on a bare GPU machine; it prints the loss before and after and the
validation loss, and saves the model in our format.

    python bench/train_fox.py --data data/packed/stage2 --steps 600 --out bench/work/fox
    python bench/attention.py --gates-from bench/work/fox/model --gates-data data/packed/stage2/val

--export-gates writes a sample of the trained log forget gates (on the validation text, heads
from the fastest-forgetting to the slowest, over every layer) as safetensors: the `trained` gate
regime of tests/test_fox_kernel.py.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from longctx.config import RunParams
from longctx.data.loader import PackedDataset
from longctx.io import atomic_dir
from longctx.train.loop import mean_loss, train
from longctx.train.models import build, preset, save_model


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, required=True, help="a packed split: data/packed/<split> (train/ and val/)")
    ap.add_argument("--shape", default="fox-125m", help="a preset shape (longctx.model.config.PRESETS)")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--micro-batch", type=int, default=2, help="packed sequences per step")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--out", type=Path, required=True, help="run folder: checkpoints/, metrics.jsonl, model/")
    ap.add_argument("--export-gates", type=Path, help="write a sample of the trained gates here (.safetensors)")
    ap.add_argument("--export-tokens", type=int, default=4224, help="tokens of that sample")
    ap.add_argument("--export-heads", type=int, default=16, help="heads of that sample")
    args = ap.parse_args(argv)
    train_data, val_data = (PackedDataset(args.data / part) for part in ("train", "val"))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = preset(args.shape, "fox", train_data.seq_len).model_copy(
        update={"vocab_size": int(train_data.index["vocab_size"])})
    model = build(cfg, device=device)
    run = RunParams(steps=args.steps, micro_batch=args.micro_batch, lr=args.lr, lr_min=args.lr / 10, warmup=0.05,
                    checkpoint_every=args.steps, keep_last=1)
    before = mean_loss(model, val_data, 8)
    last = train(model, train_data, run, args.out)
    after = mean_loss(model, val_data, 8)
    with atomic_dir(args.out / "model") as tmp:
        save_model(model, tmp, None)
    first = json.loads((args.out / "metrics.jsonl").read_text().splitlines()[0])
    summary = {"shape": args.shape, "vocab_size": cfg.vocab_size, "seq_len": train_data.seq_len, "steps": args.steps,
               "val_loss_before": round(before, 4), "val_loss_after": round(after, 4),
               "train_loss_first": round(first["loss"], 4), "train_loss_last": round(last["loss"], 4),
               "tokens_per_s": round(last["tokens_per_s"]), "model": str(args.out / "model")}
    if args.export_gates:
        summary["gates"] = export_gates(args.out / "model", args.data / "val", args.export_gates,
                                        args.export_tokens, args.export_heads, args.steps, device)
    print(json.dumps(summary), flush=True)
    return summary


def export_gates(model: Path, data: Path, path: Path, tokens: int, heads: int, steps: int,
                 device: torch.device) -> dict:
    """`heads` of the model's layers x heads log forget gates on `tokens` tokens of `data`, evenly
    spaced in order of their mean (fastest-forgetting first), fp16 [tokens, heads]."""
    from attention import model_gates  # bench/attention.py, beside this script

    gates = model_gates(model, tokens, data, str(device))
    order = gates.mean(0).argsort()
    picked = order[torch.linspace(0, gates.shape[1] - 1, heads).round().long()]
    sample = gates[:, picked].contiguous()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"log_f": sample.half()}, str(path), metadata={"steps": str(steps), "data": str(data),
                                                             "columns": ",".join(map(str, picked.tolist()))})
    mean_f = sample.exp().mean(0)
    return {"path": str(path), "mean_forget_gate": [round(x, 4) for x in mean_f.tolist()]}


if __name__ == "__main__":
    main()
