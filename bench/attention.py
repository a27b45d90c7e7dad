"""FoX attention on one GPU (docs/kernel.md): forward + backward ms (gradients of q, k, v
and, for FoX, log f) at T in {4K, 16K, 64K}, D in {64, 128}, heads x D = 2048, bf16, batch 1, for
  fa2         F.scaled_dot_product_attention(is_causal=True) on its FlashAttention-2 backend: the
              yardstick of the targets (the issue's and the FoX paper's)
  cudnn       the same on its cuDNN backend: what SDPA picks by itself on an H100/H200 with torch
              2.11, ~1.5 x faster than FlashAttention-2 here
  cudnn_doc   our 'cudnn' backend's wrapper (model/cudnn_attention.py) on the same document: the same
              kernel through graphs of its own (a batch stride no other caller has, issue 32)
  fla         fla-core's parallel_forgetting_attn, the peer FoX kernel (when installed)
  fox         our Triton kernel, every tile computed
  fox_acp     our kernel with Adaptive Computation Pruning (eps = e^-10), and its kept-tile fraction
with the seconds fox's first call took (compilation and autotuning).
Inputs: q and k RMS-normalised per head (what QK-norm gives, gains 1, so U = sqrt(D)); forget
gates synthetic as in GPU-BASELINES.md (per-head gate bias spread evenly over [1, 9] plus
N(0, 0.5) noise: about half the heads decay fast) unless --gates-from names a trained FoX
checkpoint: then its log forget gates on packed text (--gates-data, or random tokens), every
layer's heads side by side, H of them taken evenly. Targets (ratios to fa2, same run): fox <= 2.0
at 4K and <= 1.3 at 16K; fox_acp <= 0.9 at 16K and <= 0.5 at 64K. The same ratios to cudnn are
printed and written beside them.

    python bench/attention.py      # on a CUDA machine
"""

from __future__ import annotations

import argparse
import itertools
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from longctx.model import cudnn_attention
from longctx.model.fox import Acp
from longctx.model.fox import kernel as fox_kernel
from longctx.model.fox.kernel import fox_attention
from longctx.perf import write_result

YARDSTICKS = {"fa2": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
TARGETS = {("fox", 4096): 2.0, ("fox", 16384): 1.3, ("fox_acp", 16384): 0.9, ("fox_acp", 65536): 0.5}


def flops(t: int, h: int, d: int) -> float:
    """Causal forward + backward: 3.5 x the forward's 4 H T^2 D / 2 (GPU-BASELINES.md)."""
    return 3.5 * 4 * h * t * t * d / 2


def model_gates(folder: Path, tokens: int, data: Path | None = None, device: str = "cuda") -> torch.Tensor:
    """Log forget gates [tokens, layers x heads] of a trained FoX checkpoint on `tokens` tokens:
    sequences of a packed split back to back (their documents kept), or random tokens."""
    from longctx.data.loader import PackedDataset
    from longctx.train.models import load_model

    model = load_model(folder).to(device).eval()
    if model.cfg.fox is None:
        raise SystemExit(f"--gates-from {folder}: not a FoX model (no forget gates)")
    if data is None:
        ids = torch.randint(0, model.cfg.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0))
        cu = torch.tensor([0, tokens])
    else:
        split = PackedDataset(data)
        ids_parts, cus, at = [], [], 0
        for i in range(len(split)):
            seq = split[i]
            ids_parts.append(torch.from_numpy(seq.input_ids.astype("int64")))
            cus.append(torch.from_numpy(seq.cu_seqlens[:-1].astype("int64")) + at)
            at += len(seq.input_ids)
            if at >= tokens:
                break
        if at < tokens:
            raise SystemExit(f"--gates-data {data}: {at} tokens, fewer than the {tokens} asked for")
        ids = torch.cat(ids_parts)[:tokens]
        cu = torch.cat([*cus, torch.tensor([at])]).clamp(max=tokens).unique_consecutive()
        if int(ids.max()) >= model.cfg.vocab_size:
            raise SystemExit(f"--gates-data {data}: token ids reach {int(ids.max())}, past the checkpoint's "
                             f"vocabulary of {model.cfg.vocab_size} (another tokenizer?)")
    captured = []
    hooks = [layer.self_attn.fgate.register_forward_hook(lambda _m, _i, out: captured.append(F.logsigmoid(out.float())))
             for layer in model.layers]
    with torch.no_grad():
        model.hidden(ids.to(device), cu.to(device, torch.int32))
    for hook in hooks:
        hook.remove()
    return torch.cat(captured, dim=1).cpu()


def inputs(t: int, h: int, d: int, gates: torch.Tensor | None, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def unit(*shape):  # RMS-normalised heads, as after QK-norm with unit gains
        x = torch.randn(*shape, device="cuda", generator=g)
        return (x * x.pow(2).mean(-1, keepdim=True).rsqrt()).bfloat16()

    q, k = unit(t, h, d), unit(t, h, d)
    v = torch.randn(t, h, d, device="cuda", generator=g).bfloat16()
    if gates is None:
        bias = torch.linspace(1.0, 9.0, h, device="cuda")
        log_f = F.logsigmoid(bias + 0.5 * torch.randn(t, h, device="cuda", generator=g))
    else:
        pick = torch.linspace(0, gates.shape[1] - 1, h).round().long()  # H heads spread over the layers
        log_f = gates[:t, pick].float().cuda()
    do = torch.randn(t, h, d, device="cuda", generator=g).bfloat16()
    return q, k, v, log_f, do


def runners(t: int, d: int, q, k, v, log_f, do, acp: Acp):
    cu = torch.tensor([0, t], dtype=torch.int32, device="cuda")
    for x in (q, k, v, log_f):
        x.requires_grad_(True)

    def sdpa(backend: SDPBackend):
        def run():
            with sdpa_kernel(backend):
                o = F.scaled_dot_product_attention(*(x.transpose(0, 1)[None] for x in (q, k, v)), is_causal=True)
            return torch.autograd.grad(o, (q, k, v), do.transpose(0, 1)[None])

        return run

    doc_plan = cudnn_attention.plan([0, t], q.device, q.shape[1] * d)  # made once, as a training step's forward does

    def cudnn_doc():
        return torch.autograd.grad(cudnn_attention.attend(q, k, v, cu, doc_plan), (q, k, v), do)

    def fox():
        return torch.autograd.grad(fox_attention(q, k, v, cu, log_f), (q, k, v, log_f), do)

    def fox_acp():
        o = fox_attention(q, k, v, cu, log_f, acp=acp, logit_bound=math.sqrt(d))
        return torch.autograd.grad(o, (q, k, v, log_f), do)

    out = {name: sdpa(backend) for name, backend in YARDSTICKS.items()} | {"cudnn_doc": cudnn_doc, "fox": fox,
                                                                           "fox_acp": fox_acp}
    try:
        from fla.ops.forgetting_attn import parallel_forgetting_attn
    except ImportError as e:
        print(f"fla-core not usable here ({e}); its column stays empty", flush=True)
        return out

    def fla():
        o = parallel_forgetting_attn(q[None], k[None], v[None], log_f[None])
        return torch.autograd.grad(o, (q, k, v, log_f), do[None])

    return out | {"fla": fla}


def profile(lengths: list[int], dims: list[int], width: int, gates: torch.Tensor | None) -> None:
    """Where the time goes, per call of fox and fox_acp: wall ms (events, back to back as timed)
    against the sum of its kernels' ms (the difference is the GPU waiting on the host), the
    launches per call, and the costliest kernels."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    calls = 5
    for d in dims:
        for t in lengths:
            run = runners(t, d, *inputs(t, width // d, d, gates, seed=t + d), Acp())
            for name in (*YARDSTICKS, "fox", "fox_acp"):
                for _ in range(3):
                    run[name]()
                torch.cuda.synchronize()
                with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    begin.record()
                    for _ in range(calls):
                        run[name]()
                    end.record()
                    torch.cuda.synchronize()
                kernels = [e for e in prof.key_averages()
                           if str(e.device_type).endswith("CUDA") and e.self_device_time_total and "#" not in e.key]
                busy = sum(e.self_device_time_total for e in kernels) / 1e3 / calls
                launches = sum(e.count for e in kernels) / calls
                print(f"== {name} T={t} D={d}: wall {begin.elapsed_time(end) / calls:.3f} ms per call (profiled), "
                      f"kernels {busy:.3f} ms, {launches:.0f} launches")
                for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:10]:
                    print(f"   {e.self_device_time_total / 1e3 / calls:8.3f} ms  x{e.count // calls:<3} {e.key[:90]}")


def cell(row: dict, key: str, width: int = 8) -> str:
    return f"{row[key]:{width}.2f}" if key in row else f"{'-':>{width}}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    ap.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--width", type=int, default=2048, help="heads x head_dim")
    ap.add_argument("--gates-from", type=Path, help="a trained FoX checkpoint whose forget gates to use")
    ap.add_argument("--gates-data", type=Path, help="a packed split (data/packed/<split>/<part>) to run it on")
    ap.add_argument("--fla-max", type=int, default=16384, help="longest T for fla (its 64K run is minutes)")
    ap.add_argument("--profile", action="store_true", help="print each kernel's time for fox and fox_acp, no table")
    ap.add_argument("--wide", action="store_true", help="fox and fox_acp with the 64-bit offsets of sequences past "
                    "2**31 elements of q, at every length (what they cost: this run beside one without)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/attention"),
                   help="folder of the JSON (<benchmark>-<device>-<date>.json)")
    args = ap.parse_args()
    if args.wide:
        fox_kernel.OFFSET_LIMIT = 0
    result = "attention-wide" if args.wide else "attention"
    gates = model_gates(args.gates_from, max(args.lengths), args.gates_data) if args.gates_from else None
    if args.profile:
        return profile(args.lengths, args.dims, args.width, gates)

    rows = []
    for d in args.dims:
        h = args.width // d
        for t in args.lengths:
            acp = Acp()
            row = {"T": t, "D": d, "H": h, "gates": str(args.gates_from) if gates is not None else "synthetic"}
            for name, fn in runners(t, d, *inputs(t, h, d, gates, seed=t + d), acp).items():
                if name == "fla" and t > args.fla_max:
                    continue
                if name == "fox":
                    begin = time.perf_counter()
                    fn()
                    torch.cuda.synchronize()
                    row["fox_first_call_s"] = time.perf_counter() - begin
                ms = triton.testing.do_bench(fn, warmup=100, rep=400 if t < 65536 else 2000, return_mode="median")
                row[f"{name}_ms"] = ms
                row[f"{name}_tflops"] = flops(t, h, d) / ms / 1e9
                if name == "fox_acp":
                    acp.stats.pruned_fraction()  # the warm-up and timed calls: reset, then one clean call
                    fn()
                    row["kept_fraction"] = 1 - acp.stats.pruned_fraction()
                torch.cuda.empty_cache()
            for name, base in itertools.product(("cudnn_doc", "fla", "fox", "fox_acp"), YARDSTICKS):
                if f"{name}_ms" in row:
                    row[f"{name}_vs_{base}"] = row[f"{name}_ms"] / row[f"{base}_ms"]
            rows.append(row)
            print({k_: round(x, 3) if isinstance(x, float) else x for k_, x in row.items()}, flush=True)
            write_result(args.out, result, {"rows": rows, "triton": triton.__version__}, quiet=True)  # kept if cut

    print(f"{'T':>6} {'D':>4} {'fa2 ms':>8} {'cudnn ms':>8} {'doc ms':>8} {'fla ms':>8} {'fox ms':>8} {'acp ms':>8} "
          f"{'kept':>6} {'fla/fa2':>8} {'fox/fa2':>8} {'acp/fa2':>8} {'doc/cud':>8} {'fox/cud':>8} {'acp/cud':>8} "
          f"{'1st s':>6}")
    for r in rows:
        cells = [cell(r, f"{key}_ms") for key in ("fa2", "cudnn", "cudnn_doc", "fla", "fox", "fox_acp")]
        cells += [cell(r, "kept_fraction", 6)] + [cell(r, f"{key}_vs_fa2") for key in ("fla", "fox", "fox_acp")]
        cells += [cell(r, f"{key}_vs_cudnn") for key in ("cudnn_doc", "fox", "fox_acp")]
        cells += [cell(r, "fox_first_call_s", 6)]
        print(f"{r['T']:>6} {r['D']:>4} " + " ".join(cells))
    verdicts = {}
    for ((name, t), limit), base in itertools.product(TARGETS.items(), YARDSTICKS):
        got = [r[f"{name}_vs_{base}"] for r in rows if r["T"] == t and f"{name}_vs_{base}" in r]
        if got:
            met = all(x <= limit for x in got)
            verdicts[f"{name}@{t}<={limit} x {base}"] = {"ratios": got, "met": met}
            print(f"target {name} at T={t}: <= {limit} x {base}: {[f'{x:.2f}' for x in got]} "
                  f"{'met' if met else 'NOT met'}{'' if base == 'fa2' else ' (cuDNN, for comparison)'}")
    write_result(args.out, result, {"rows": rows, "targets": verdicts, "wide": args.wide, "triton": triton.__version__})


if __name__ == "__main__":
    main()
