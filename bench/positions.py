"""SeqPE's claim in miniature ("Transformer with Sequential Position Encoding", 2025; issue 17): one
small model shape trained the same steps on the same text at the same length with each position
encoding — RoPE, a learned table (APE, clamped past its end), ALiBi, SeqPE (its regularisers and
shifts on) and FoX (Pro) — then the
per-position loss on long validation documents, its mean over [0, L), [L, 2L), [2L, 4L),
[4L, 8L) and the perplexity of the first 1, 2, 4 and 8 x L tokens, L the training length; and
each model's training tokens/s against RoPE's (the stages' own loop, eager, so SeqPE's
regularisers and the other encodings run alike). A model whose training diverges is reported so
and scored at its last good step. Writes the table as JSON and the per-position loss as a plot.

    python bench/positions.py --data data/packed/stage2     # GPU (CPU works)
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from longctx.config import RunParams
from longctx.data.loader import PackedDataset, Sample
from longctx.eval.needle import long_documents, position_loss
from longctx.eval.plots import position_loss as plot_position_loss
from longctx.model.attention import resolve
from longctx.model.config import FoxConfig, LearnedPositions, ModelConfig, RopeConfig, SeqPEConfig
from longctx.perf import write_result
from longctx.train.flops import flop_params
from longctx.train.loop import TrainingDiverged, train
from longctx.train.models import build

ENCODINGS = {
    "RoPE": dict(rope=RopeConfig(theta=10000.0)),
    "learned (APE)": dict(rope=None, learned_positions=LearnedPositions(beyond="clamp")),
    "ALiBi": dict(rope=None, alibi=True),
    "SeqPE": dict(rope=None, seqpe=SeqPEConfig(digits=5, dim=256, layers=2, heads=4)),
    "FoX (Pro)": dict(rope=None, fox=FoxConfig()),
}
SHAPES = {"small": dict(d_model=512, n_layers=8, n_heads=8, ffn_dim=1408),  # ~30M with a 4K vocabulary
          "tiny": dict(d_model=32, n_layers=2, n_heads=4, ffn_dim=64)}  # CPU tests
MULTIPLES = (1, 2, 4, 8)


class Windows:
    """A packed split cut into `length`-token training sequences (documents kept, cut at the
    window's edges): every model sees the same text at the same length."""

    def __init__(self, data: PackedDataset, length: int):
        if data.seq_len % length:
            raise SystemExit(f"--train-len {length} does not divide the split's sequence length {data.seq_len}")
        self.data, self.seq_len, self.per = data, length, data.seq_len // length
        self.index = data.index

    def __len__(self) -> int:
        return len(self.data) * self.per

    def __getitem__(self, i: int) -> Sample:
        s = self.data[i // self.per]
        a = (i % self.per) * self.seq_len
        b = a + self.seq_len
        ends = np.cumsum(s.doc_lens)
        starts = ends - s.doc_lens
        keep = (ends > a) & (starts < b)
        lens = np.minimum(ends[keep], b) - np.maximum(starts[keep], a)
        mask = None if s.loss_mask is None else s.loss_mask[a:b]
        return Sample(s.input_ids[a:b], lens, s.domains[keep], mask)

    def provenance(self, i: int) -> list[dict]:
        return self.data.provenance(i // self.per)


def evaluate(model: torch.nn.Module, docs: list[np.ndarray], length: int) -> dict:
    """Mean loss per band of positions and perplexity of each prefix, in multiples of `length`."""
    with torch.no_grad():
        loss = position_loss(model, docs)  # loss of predicting token t + 1 at position t
    out = {}
    for lo, hi in zip((0, *MULTIPLES[:-1]), MULTIPLES, strict=True):
        out[f"loss_{lo}L_{hi}L"] = float(loss[lo * length: hi * length - 1].mean())
    for m in MULTIPLES:
        out[f"ppl_{m}L"] = math.exp(float(loss[: m * length - 1].mean()))
    return {**out, "curve": loss}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, required=True, help="a packed split (train/, val/) with long documents")
    ap.add_argument("--train-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--shape", choices=list(SHAPES), default="small")
    ap.add_argument("--eval-docs", type=int, default=8)
    ap.add_argument("--models", nargs="*", choices=list(ENCODINGS), default=list(ENCODINGS))
    ap.add_argument("--work", type=Path, default=Path("bench/work/positions"), help="run folders (checkpoints)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/positions"),
                   help="folder of the JSON (<benchmark>-<device>-<date>.json)")
    ap.add_argument("--anomaly", action="store_true", help="autograd anomaly detection: a NaN made in a backward "
                    "operation stops training and names that operation (its forward's stack goes to stderr)")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    train_data, val = Windows(PackedDataset(args.data / "train"), args.train_len), PackedDataset(args.data / "val")
    longest = MULTIPLES[-1] * args.train_len
    docs = [val[i].input_ids[:longest] for i in long_documents(val, longest)[: args.eval_docs]]
    if not docs:
        raise SystemExit(f"{args.data / 'val'}: no document of {longest} tokens to evaluate 8 x --train-len on")
    run = RunParams(steps=args.steps, micro_batch=args.micro_batch, lr=args.lr, lr_min=args.lr / 10, warmup=0.05,
                    checkpoint_every=args.steps, keep_last=1, compile=False)
    rows, curves = [], []
    for name in args.models:
        cfg = ModelConfig(vocab_size=int(train_data.index["vocab_size"]), max_position_embeddings=args.train_len,
                          **SHAPES[args.shape], **ENCODINGS[name])
        model = build(cfg, device=device)
        begin = time.perf_counter()
        work = args.work / name.split()[0].lower()
        diverged = None  # if it does: reported, and the weights of the last good step scored
        try:
            with torch.autograd.set_detect_anomaly(args.anomaly, check_nan=True):
                train(model, train_data, run, work, resume=False)
        except TrainingDiverged as e:
            diverged = str(e).split(";")[0]
        except RuntimeError as e:  # --anomaly: the backward operation that first made a NaN
            if not (args.anomaly and "nan" in str(e)):
                raise
            diverged = f"anomaly: {e}"
        if diverged:
            print(f"{name}: {diverged}", flush=True)
        seconds = time.perf_counter() - begin
        steps = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
        late = steps[len(steps) // 2:]  # after the warm-up
        row = {"model": name, "position": cfg.position, "params": flop_params(model),
               "attention": resolve("auto", device, cfg.fox is not None or cfg.alibi),
               "train_seconds": round(seconds, 1),
               "tokens_per_s": round(statistics.median(s["tokens_per_s"] for s in late)),
               "train_loss_last": round(steps[-1]["loss"], 4)}
        if diverged:
            row["diverged"] = diverged
            row["last_logged"] = steps[-1]
        if "seqpe_regularisers_ms" in late[0]:
            row["seqpe_regularisers_ms"] = round(statistics.median(s["seqpe_regularisers_ms"] for s in late), 2)
        result = evaluate(model, docs, args.train_len)
        curve = result.pop("curve")
        row.update({k: round(v, 4) for k, v in result.items()})
        rows.append(row)
        window = max(1, args.train_len // 16)
        curves += [{"checkpoint": name, "position": p + window // 2, "loss": float(curve[p:p + window].mean())}
                   for p in range(0, len(curve) - window + 1, window)]
        print({k: v for k, v in row.items()}, flush=True)
        write_result(args.out, "positions", {"rows": rows, "train_len": args.train_len}, device=device_name, quiet=True)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    rope = next((r for r in rows if r["model"] == "RoPE"), None)
    for r in rows:
        if rope:
            r["tokens_per_s_vs_rope"] = round(r["tokens_per_s"] / rope["tokens_per_s"], 3)
    print(f"\ntrained at {args.train_len} tokens, {args.steps} steps of {args.micro_batch} sequences, "
          f"{len(docs)} validation documents of {longest} tokens ({device.type})")
    print(f"{'model':<15} {'params':>9} {'tokens/s':>9} {'vs RoPE':>7} " +
          " ".join(f"{f'ppl {m}L':>9}" for m in MULTIPLES) + f" {'loss 4-8L':>9}")
    for r in rows:
        print(f"{r['model']:<15} {r['params']:>9} {r['tokens_per_s']:>9} {r.get('tokens_per_s_vs_rope', '-'):>7} " +
              " ".join(f"{r[f'ppl_{m}L']:>9.2f}" for m in MULTIPLES) + f" {r['loss_4L_8L']:>9.3f}" +
              (f"  ({r['diverged']})" if "diverged" in r else ""))
    claim = {}
    seqpe = next((r for r in rows if r["model"] == "SeqPE"), None)
    if seqpe:
        for other in ("RoPE", "learned (APE)"):
            base = next((r for r in rows if r["model"] == other), None)
            if base:
                beyond = {f"{m}L": seqpe[f"ppl_{m}L"] < base[f"ppl_{m}L"] for m in MULTIPLES[1:]}
                claim[f"SeqPE below {other} beyond L"] = beyond
                print(f"SeqPE's perplexity below {other}'s beyond the training length: {beyond}")
    path = write_result(args.out, "positions", {"rows": rows, "claim": claim, "train_len": args.train_len,
                                                "steps": args.steps, "micro_batch": args.micro_batch,
                                                "shape": args.shape, "eval_docs": len(docs)}, device=device_name)
    plot_position_loss(curves, path.with_suffix(".png"), args.train_len)
    return {"rows": rows, "claim": claim, "json": path}


if __name__ == "__main__":
    main()
