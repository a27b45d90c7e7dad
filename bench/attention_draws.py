"""Attention's part of a long training step, draw by draw (issue 34). bench/scale.py times a step
of generated documents, lengths log-uniform in [1K, seq]; attention costs the sum of the squared
lengths, so one timed step is one sample: at 1,048,576 tokens that sum over seq^2 (the density)
spans 0.09..0.85 in the first 40 draws, mean 0.41, and the millions rows timed the draw of 0.09.

Per draw (the seeds scale.py's steps take: step i draws seed 1000 i), one layer's attention core
as one rank of Ulysses SP runs it (the whole sequence, that rank's heads), timed as `halves`
recomputation runs it: the forward without gradients, then forward and backward again. The
inputs are layer 0 of the shape at its initialisation on unit-RMS hidden states (what the input
norm gives), so FoX (Pro)'s forget gates are the model's initial ones: biases spread over 1..6
across the heads, which each rank takes its own share of; layers wait for their slowest rank, so
FoX's time is the slowest rank's. The Transformer's kernels take time by shape alone: one rank.

With --steps (scale.py's JSON of both models at this shape and length), each draw's step is
estimated as a measured step with its attention swapped: step + layers x (a(draw) - a(timed
draw)); the first step (draw 0, compilation included) less its estimate is what compiling cost,
a check of the swap when both models give about the same. Printed: the table and the ratio of
the models' total time over all draws (the same tokens).

    python bench/attention_draws.py --seq 1048576 --sp 2 --draws 12 \\
        --steps bench/results/scale-2gpu-*1024k-offload-halves-keep6-*.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from scale import density, documents

from longctx.model import attention
from longctx.model.fox import Acp
from longctx.model.transformer import Transformer, packed_positions
from longctx.perf import write_result
from longctx.train.models import preset

MODELS = {"Transformer": "llama", "FoX (Pro)": "fox"}


class Layer:
    """Layer 0 of the shape, at initialisation, and its attention core over each rank's heads."""

    def __init__(self, shape: str, arch: str, seq: int, sp: int, device: torch.device, seed: int = 0):
        torch.manual_seed(seed)
        cfg = preset(shape, arch, seq).model_copy(update={"n_layers": 1})
        if cfg.n_heads % sp or cfg.kv_heads % sp:
            raise SystemExit(f"--sp {sp}: {shape} has {cfg.n_heads} query and {cfg.kv_heads} key/value heads")
        self.model = Transformer(cfg).to(device, torch.bfloat16)
        self.attn = self.model.layers[0].self_attn
        self.sp, self.device = sp, device
        self.backend = attention.resolve("auto", device, arch == "fox")
        if arch == "fox" and self.backend == "fox":
            self.model.acp = Acp()

    def heads(self, n: int, ranks: int) -> list[list[torch.Tensor | None]]:
        """Per rank of the first `ranks`: q, k, v, log f and KV-shift's gates of its heads for n unit-RMS tokens (the
        same tokens: after Ulysses' exchange every rank holds the whole sequence), as leaves."""
        x = torch.randn(n, self.model.cfg.d_model, device=self.device, dtype=torch.bfloat16,
                        generator=torch.Generator(self.device).manual_seed(0))
        with torch.no_grad():
            parts = self.attn.project(x)
        widths = (self.attn.h, self.attn.hk, self.attn.hk, self.attn.h, self.attn.hk, self.attn.hk)
        return [[None if t is None else t[:, r * (w // self.sp):(r + 1) * (w // self.sp)].contiguous().requires_grad_()
                 for t, w in zip(parts, widths, strict=True)] for r in range(ranks)]

    def time(self, bounds: torch.Tensor, ranks: int) -> list[tuple[float, float | None]]:
        """Per rank of the first `ranks`: (seconds of a forward without gradients, then forward +
        backward; the kept fraction of causal tiles under ACP, or None)."""
        n, cu = int(bounds[-1]), bounds.to(self.device)
        cos, sin = self.model.rotary(packed_positions(cu, n), cu, torch.bfloat16)
        ctx = self.model.attention_context(cu, n, cos, sin, bounds.tolist())
        out = []
        for parts in self.heads(n, ranks):
            sync()
            begin = time.perf_counter()
            with torch.no_grad():
                self.attn.core(*parts, ctx)
            o, tiles = self.attn.core(*parts, ctx)
            o.backward(torch.ones_like(o))
            sync()
            out.append((time.perf_counter() - begin,
                        None if tiles is None else float(tiles[0]) / max(float(tiles[1]), 1.0)))
        return out


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_draws(row: dict) -> list[int]:
    """The draws of a scale.py row's timed (queued) steps."""
    if "timed_draws" in row:
        return row["timed_draws"]
    if len(row["losses"]) == 2:  # --warmup 0 --steps 1 (the millions rows): draw 0 isolated, draw 1 timed
        return [1]
    raise SystemExit(f"a scale.py row of {row['model']} at {row['seq']} does not say which draws it timed "
                     "(rerun it, or give rows of --warmup 0 --steps 1)")


def measured(paths: list[Path], shape: str, seq: int, sp: int, draws: int) -> dict[str, dict]:
    """scale.py's row of each model at this shape, length and SP in the JSON files `paths`,
    checked before any timing: one per model, its timed draws among those timed here."""
    rows: dict[str, dict] = {}
    for path in paths:
        try:
            res = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise SystemExit(f"--steps {path}: {e}") from None
        for r in res.get("rows", []):
            if res.get("shape") != shape or r.get("seq") != seq or r.get("sp") != sp or "step_s" not in r:
                continue
            if r["model"] in rows:
                raise SystemExit(f"--steps: more than one row of {r['model']} at {seq} tokens, SP {sp} ({path})")
            if max(timed_draws(r)) >= draws:
                raise SystemExit(f"--steps {path}: {r['model']} timed draws {timed_draws(r)}; --draws {draws} "
                                 "does not reach them")
            rows[r["model"]] = r
    return rows


def estimates(rows: list[dict], steps: dict[str, dict], layers: int) -> dict:
    """Per model with a measured row: each draw's estimated step (the measured step, its timed
    draws' attention swapped for this draw's), and what the first step (draw 0) spent beyond its
    estimate."""
    out = {}
    for model, row in steps.items():
        a = [r["seconds"][model] for r in rows]
        timed = timed_draws(row)
        base = row["step_s"] - layers * sum(a[i] for i in timed) / len(timed)
        est = [base + layers * x for x in a]
        out[model] = {"step_s": row["step_s"], "timed_draws": timed, "estimated_step_s": [round(s, 2) for s in est],
                      "first_step_s": row["first_step_s"], "first_step_beyond_estimate_s":
                      round(row["first_step_s"] - est[0], 2)}
    if len(out) == len(MODELS):
        total = {m: sum(out[m]["estimated_step_s"]) for m in MODELS}
        out["ratio_over_draws"] = round(total["Transformer"] / total["FoX (Pro)"], 3)
        out["ratio_at_timed_draw"] = round(out["Transformer"]["step_s"] / out["FoX (Pro)"]["step_s"], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--seq", type=int, default=1048576)
    ap.add_argument("--sp", type=int, default=2, help="Ulysses ranks: each times its share of the heads")
    ap.add_argument("--draws", type=int, default=12, help="draws 0..N-1 (scale.py's steps 0..N-1)")
    ap.add_argument("--steps", type=Path, nargs="*", default=[], help="scale.py JSON of the models at this "
                    "shape, length and SP: estimate every draw's step")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    steps = measured(args.steps, args.shape, args.seq, args.sp, args.draws)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    layers = {m: Layer(args.shape, arch, args.seq, args.sp, device) for m, arch in MODELS.items()}
    draws = [documents(args.seq, 1000 * i) for i in range(args.draws)]
    for layer in layers.values():  # compilation and autotuning, untimed
        layer.time(draws[0], 1)
    rows = []
    print(f"{'draw':>4} {'docs':>5} {'longest':>8} {'density':>7} {'Transformer s':>13} {'FoX s (ranks)':>24} "
          f"{'FoX kept':>8}", flush=True)
    for i, bounds in enumerate(draws):
        ((t, _),) = layers["Transformer"].time(bounds, 1)
        fox = layers["FoX (Pro)"].time(bounds, args.sp)
        kept = [k for _, k in fox if k is not None]
        row = {"draw": i, "seed": 1000 * i, "documents": len(bounds) - 1,
               "longest": int((bounds[1:] - bounds[:-1]).max()), "density": round(density(args.seq, [i], 1), 4),
               "seconds": {"Transformer": round(t, 4), "FoX (Pro)": round(max(s for s, _ in fox), 4)},
               "fox_rank_seconds": [round(s, 4) for s, _ in fox],
               "fox_kept_fraction": round(sum(kept) / len(kept), 4) if kept else None}
        rows.append(row)
        print(f"{i:>4} {row['documents']:>5} {row['longest']:>8} {row['density']:>7.3f} {t:>13.3f} "
              f"{' / '.join(f'{s:.3f}' for s, _ in fox):>24} {row['fox_kept_fraction'] or '-':>8}", flush=True)
    n_layers = preset(args.shape).n_layers
    est = estimates(rows, steps, n_layers)
    for model in MODELS:
        if model in est:
            e = est[model]
            print(f"{model}: measured {e['step_s']} s at draw {e['timed_draws']}; estimated per draw "
                  f"{e['estimated_step_s']}; first step {e['first_step_s']} s, {e['first_step_beyond_estimate_s']} s "
                  "beyond its estimate (compilation)")
    if "ratio_over_draws" in est:
        print(f"FoX (Pro)+ACP over the Transformer: {est['ratio_at_timed_draw']}x at the timed draw, "
              f"{est['ratio_over_draws']}x over draws 0..{args.draws - 1}")
    fields = {"shape": args.shape, "seq": args.seq, "sp": args.sp, "layers": n_layers,
              "backends": {m: layer.backend + ("+acp" if layer.model.acp else "") for m, layer in layers.items()},
              "timing": "one layer's attention core per draw, halves recomputation: forward, then forward + backward",
              "rows": rows, "estimates": est}
    if device.type == "cuda":
        write_result(args.out, f"attention_draws-{args.seq // 1024}k-sp{args.sp}", fields)
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"attention_draws-cpu-{args.seq}.json").write_text(json.dumps(fields, indent=2) + "\n")


if __name__ == "__main__":
    main()
