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
the models' total time over all draws (the same tokens). --backends times the Transformer on
several attention backends side by side (the first is "Transformer", the others "Transformer
(name)"); each gets its estimates from the measured step with the attention of the backend that
step ran with (its row's `attention`, else --steps-attention) swapped for its own.

    python bench/attention_draws.py --seq 1048576 --sp 2 --draws 12 \\
        --steps bench/results/scale-2gpu-*1024k-offload-halves-keep6-*.json
    python bench/attention_draws.py --backends cudnn varlen --steps-attention varlen --steps ...
"""

from __future__ import annotations

import argparse
import functools
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


class Layer:
    """Layer 0 of the shape, at initialisation, and its attention core over each rank's heads."""

    def __init__(self, shape: str, arch: str, seq: int, sp: int, device: torch.device, backend: str = "auto",
                 seed: int = 0):
        torch.manual_seed(seed)
        cfg = preset(shape, arch, seq).model_copy(update={"n_layers": 1})
        if cfg.n_heads % sp or cfg.kv_heads % sp:
            raise SystemExit(f"--sp {sp}: {shape} has {cfg.n_heads} query and {cfg.kv_heads} key/value heads")
        self.model = Transformer(cfg, attention_backend=backend).to(device, torch.bfloat16)
        self.attn = self.model.layers[0].self_attn
        self.sp, self.device = sp, device
        self.backend = attention.resolve(backend, device, arch == "fox")
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

    def time(self, bounds: torch.Tensor, ranks: int) -> list[tuple[float, float | None, float | None]]:
        """Per rank of the first `ranks`: (seconds of a forward without gradients, then forward +
        backward; the kept fraction of causal tiles under ACP, or None; the GiB the core allocated
        at its peak beyond its inputs, None on the CPU: eager, its norms' and RoPE's intermediates
        in it, where training compiles the block)."""
        n, cu = int(bounds[-1]), bounds.to(self.device)
        cos, sin = self.model.rotary(packed_positions(cu, n), cu, torch.bfloat16)
        ctx = self.model.attention_context(cu, n, cos, sin, bounds.tolist())
        if self.backend == "cudnn":  # routed as a rank routes under SP: by its share of the heads
            ctx.attend = functools.partial(attention.cudnn, plan=attention.plan(
                "cudnn", bounds.tolist(), self.device, self.attn.h // self.sp * self.attn.d))
        out = []
        for parts in self.heads(n, ranks):
            sync()
            cuda = self.device.type == "cuda"
            if cuda:
                torch.cuda.reset_peak_memory_stats(self.device)
                held = torch.cuda.memory_allocated(self.device)
            begin = time.perf_counter()
            with torch.no_grad():
                self.attn.core(*parts, ctx)
            o, tiles = self.attn.core(*parts, ctx)
            o.backward(torch.ones_like(o))
            sync()
            out.append((time.perf_counter() - begin,
                        None if tiles is None else float(tiles[0]) / max(float(tiles[1]), 1.0),
                        (torch.cuda.max_memory_allocated(self.device) - held) / 2**30 if cuda else None))
        return out


def gib(n: float | None) -> float | None:
    return None if n is None else round(n, 2)


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


def estimates(rows: list[dict], steps: dict[str, dict], layers: int, ran_with: dict[str, str],
              tokens_per_gpu: int) -> dict:
    """Per timed label of a model with a measured row: each draw's estimated step (the measured
    step, its timed draws' attention, timed under the label `ran_with[model]` names, swapped for
    this label's attention of this draw), the tokens/s a GPU over all draws, and what the first
    step (draw 0) spent beyond its estimate."""
    out = {}
    for label in rows[0]["seconds"] if rows else []:
        model = label.split(" (")[0] if label.startswith("Transformer") else label
        if model not in steps:
            continue
        row, by_draw = steps[model], {r["draw"]: r["seconds"] for r in rows}
        timed = timed_draws(row)
        base = row["step_s"] - layers * sum(by_draw[i][ran_with[model]] for i in timed) / len(timed)
        est = [base + layers * r["seconds"][label] for r in rows]
        out[label] = {"step_s": row["step_s"], "timed_draws": timed, "estimated_step_s": [round(s, 2) for s in est],
                      "tokens_per_s_per_gpu_over_draws": round(tokens_per_gpu * len(est) / sum(est), 1),
                      "first_step_s": row["first_step_s"], "first_step_beyond_estimate_s":
                      round(row["first_step_s"] - est[0], 2)}
    if "FoX (Pro)" in out and "Transformer" in out:
        fox = out["FoX (Pro)"]
        at = [[r["draw"] for r in rows].index(i) for i in fox["timed_draws"]]
        out["ratios"] = {label: {"over_draws": round(sum(e["estimated_step_s"]) / sum(fox["estimated_step_s"]), 3),
                                 "at_timed_draw": round(sum(e["estimated_step_s"][i] for i in at)
                                                        / len(at) / fox["step_s"], 3)}
                         for label, e in out.items() if label.startswith("Transformer")}
        out["ratio_over_draws"] = out["ratios"]["Transformer"]["over_draws"]
        out["ratio_at_timed_draw"] = out["ratios"]["Transformer"]["at_timed_draw"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--seq", type=int, default=1048576)
    ap.add_argument("--sp", type=int, default=2, help="Ulysses ranks: each times its share of the heads")
    ap.add_argument("--draws", type=int, default=12, help="draws 0..N-1 (scale.py's steps 0..N-1)")
    ap.add_argument("--steps", type=Path, nargs="*", default=[], help="scale.py JSON of the models at this "
                    "shape, length and SP: estimate every draw's step")
    ap.add_argument("--backends", nargs="+", default=["auto"], help="the Transformer's attention backends, "
                    "each timed on every draw")
    ap.add_argument("--steps-attention", help="the backend the --steps rows' Transformer ran with where a row "
                    "does not say (rows before 2026-11-29: varlen); default: the first of --backends")
    ap.add_argument("--only", type=int, nargs="+", help="time these draws alone (those the steps timed among "
                    "them): to finish a run that was cut")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    only = args.only if args.only is not None else list(range(args.draws))
    if not set(only) <= set(range(args.draws)):
        ap.error(f"--only {args.only}: draws are 0..{args.draws - 1}")
    steps = measured(args.steps, args.shape, args.seq, args.sp, args.draws)
    for model, row in steps.items():
        if not set(timed_draws(row)) <= set(only):
            ap.error(f"--only {only}: the {model} step timed draws {timed_draws(row)}; time them too")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    names = [attention.resolve(b, device, False) for b in args.backends]  # (an impossible one refused here)
    labels = {name: "Transformer" if i == 0 else f"Transformer ({name})" for i, name in enumerate(names)}
    ran = steps.get("Transformer", {}).get("attention") or (attention.resolve(args.steps_attention, device, False)
                                                            if args.steps_attention else names[0])
    if "Transformer" in steps and ran not in labels:
        raise SystemExit(f"--steps: the Transformer's step ran on {ran!r}; give it in --backends to swap its attention")
    ran_with = {"Transformer": labels.get(ran, "Transformer"), "FoX (Pro)": "FoX (Pro)"}
    layers = {labels[name]: Layer(args.shape, "llama", args.seq, args.sp, device, name) for name in labels}
    layers["FoX (Pro)"] = Layer(args.shape, "fox", args.seq, args.sp, device)
    draws = {i: documents(args.seq, 1000 * i) for i in only}
    for layer in layers.values():  # compilation and autotuning, untimed
        layer.time(draws[only[0]], 1)
    n_layers = preset(args.shape).n_layers
    fields = {"shape": args.shape, "seq": args.seq, "sp": args.sp, "layers": n_layers,
              "backends": {m: layer.backend + ("+acp" if layer.model.acp else "") for m, layer in layers.items()},
              "steps_attention": ran if "Transformer" in steps else None,
              "timing": "one layer's attention core per draw, halves recomputation: forward, then forward + backward",
              "rows": []}
    rows = fields["rows"]
    print(f"{'draw':>4} {'docs':>5} {'longest':>8} {'density':>7} "
          + " ".join(f"{names[i] + ' s':>13}" for i in range(len(names))) + f" {'FoX s (ranks)':>24} {'FoX kept':>8}"
          + " " + " ".join(f"{names[i] + ' GiB':>13}" for i in range(len(names))),
          flush=True)
    for i, bounds in draws.items():
        plain = {label: layers[label].time(bounds, 1)[0] for label in labels.values()}
        fox = layers["FoX (Pro)"].time(bounds, args.sp)
        kept = [k for _, k, _ in fox if k is not None]
        row = {"draw": i, "seed": 1000 * i, "documents": len(bounds) - 1,
               "longest": int((bounds[1:] - bounds[:-1]).max()), "density": round(density(args.seq, [i], 1), 4),
               "seconds": {**{label: round(t[0], 4) for label, t in plain.items()},
                           "FoX (Pro)": round(max(s for s, _, _ in fox), 4)},
               "peak_gib": {**{label: gib(t[2]) for label, t in plain.items()},
                            "FoX (Pro)": gib(max((p for _, _, p in fox if p is not None), default=None))},
               "fox_rank_seconds": [round(s, 4) for s, _, _ in fox],
               "fox_kept_fraction": round(sum(kept) / len(kept), 4) if kept else None}
        rows.append(row)
        print(f"{i:>4} {row['documents']:>5} {row['longest']:>8} {row['density']:>7.3f} "
              + " ".join(f"{t[0]:>13.3f}" for t in plain.values())
              + f" {' / '.join(f'{s:.3f}' for s, _, _ in fox):>24} {row['fox_kept_fraction'] or '-':>8} "
              + " ".join(f"{row['peak_gib'][label] or '-':>13}" for label in plain), flush=True)
        save(fields, args.out, device)  # the rows so far kept if the run is cut
    est = fields["estimates"] = estimates(rows, steps, n_layers, ran_with, args.seq // args.sp)
    for label, e in est.items():
        if isinstance(e, dict) and "step_s" in e:
            print(f"{label}: measured {e['step_s']} s at draw {e['timed_draws']}"
                  f"{f' (on {ran})' if label.startswith('Transformer') else ''}; estimated per draw "
                  f"{e['estimated_step_s']}: {e['tokens_per_s_per_gpu_over_draws']} tokens/s/GPU over the draws; "
                  f"first step {e['first_step_s']} s, {e['first_step_beyond_estimate_s']} s beyond its estimate "
                  "(compilation)")
    for label, r in est.get("ratios", {}).items():
        print(f"FoX (Pro)+ACP over {label}: {r['at_timed_draw']}x at the timed draw, {r['over_draws']}x over draws "
              f"{'0..' + str(args.draws - 1) if args.only is None else only}")
    save(fields, args.out, device, quiet=False)


def save(fields: dict, out: Path, device: torch.device, quiet: bool = True) -> None:
    if device.type == "cuda":
        write_result(out, f"attention_draws-{fields['seq'] // 1024}k-sp{fields['sp']}", fields, quiet=quiet)
    else:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"attention_draws-cpu-{fields['seq']}.json").write_text(json.dumps(fields, indent=2) + "\n")


if __name__ == "__main__":
    main()
