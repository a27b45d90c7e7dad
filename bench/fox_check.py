"""The FoX kernel checked where training lives (issue 31), on one GPU, tuning on as users run it:

  kernel    the issue's cases (mixed fast- and slow-forgetting heads, length-1 documents among
            long ones, bf16 / fp16, GQA 4): per-head relative errors of out, dq, dk, dv and d log f
            against float64, on each shape's first, autotuned call and on later ones; with
            --before, a kernel.py of another commit beside ours on the same inputs, and both
            kernels' fwd + bwd ms at 16K beside SDPA's FlashAttention-2 and cuDNN
  training  FoX (Pro) of the 125M shape on a packed split (many documents per sequence), the
            training loop's own precision and compiled blocks: one step with the `fox` backend
            against the same step with `flex` (per-layer cosine of every gradient, the loss), then
            --steps steps of each from the same seed and data: the validation losses

Targets: per-head errors <= 2e-2 (bf16) / 5e-3 (fp16); every gradient's cosine >= 0.999; losses
within 0.1% after one step and 0.5% after training.

    python bench/fox_check.py --data data/packed/stage2 --before bench/work/kernel_cf47ec1.py --out bench/results
"""

from __future__ import annotations

import argparse
import sys
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from longctx.config import RunParams
from longctx.data.loader import PackedDataset
from longctx.model.fox import reference
from longctx.perf import write_result
from longctx.train.batches import make_batch
from longctx.train.loop import autocast, mean_loss, prepare, train
from longctx.train.models import build, preset
from longctx.train.parallel import Parallel

TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}
MIN_COSINE = 0.999
DEV = torch.device("cuda")


def load_kernel(path: Path | None) -> types.ModuleType:
    """Our kernel module, or the kernel.py at `path` (another commit's) as a module of its own:
    its custom ops renamed, so both register side by side, with autotuners of their own."""
    if path is None:
        from longctx.model.fox import kernel

        return kernel
    name = f"longctx.model.fox.{path.stem}"
    module = types.ModuleType(name)
    module.__package__, module.__file__ = "longctx.model.fox", str(path)
    sys.modules[name] = module
    exec(compile(path.read_text().replace('"longctx::', '"longctx_before::'), str(path), "exec"), module.__dict__)
    return module


# --- kernel ----------------------------------------------------------------------------------

def nine_documents(n: int) -> list[int]:
    """The issue's layout at n tokens: length-1 documents at 5, 6 and the end, six long ones."""
    inner = [round(c * n / 4099) for c in (348, 1230, 2865, 3500)]
    return [0, 5, 6, 7, *inner, n - 1, n]


CASES = [  # (name, n, d, dtype, gates, layout)
    ("mixed gates, 9 documents", 4099, 64, torch.bfloat16, "mixed", "nine"),
    ("tests' gates, 9 documents", 4099, 64, torch.bfloat16, "gentle", "nine"),
    ("mixed gates, one document", 4099, 64, torch.bfloat16, "mixed", "one"),
    ("mixed gates, 9 documents, N 12,289, D 96", 12289, 96, torch.bfloat16, "mixed", "nine"),
    ("mixed gates, 9 documents, D 128, fp16", 4099, 128, torch.float16, "mixed", "nine"),
]
BEFORE_CASES = 3  # the first three share one tuning key: the before kernel's first call and two after


def case_inputs(n: int, d: int, dtype: torch.dtype, gates: str, layout: str, h: int = 8, hk: int = 2):
    gen = torch.Generator().manual_seed(n + d)
    q, k, v = (torch.randn(n, x, d, generator=gen).to(DEV, dtype) for x in (h, hk, hk))
    if gates == "mixed":  # one head per decay rate, f ~ 0.6 .. 0.999
        log_f = F.logsigmoid(torch.linspace(0.5, 7.0, h)[None] + 0.7 * torch.randn(n, h, generator=gen))
    else:
        log_f = F.logsigmoid(2 * torch.randn(n, h, generator=gen) + 4)
    do = torch.randn(n, h, d, generator=gen).to(DEV, dtype)
    cu = torch.tensor(nine_documents(n) if layout == "nine" else [0, n], dtype=torch.int32, device=DEV)
    return q, k, v, log_f.to(DEV), cu, do


def expected(q, k, v, log_f, cu, do) -> list[torch.Tensor]:
    """float64 out, dq, dk, dv, d log f, one query head at a time (N = 12K fits)."""
    h, hk = q.shape[1], k.shape[1]
    outs, dqs, dlfs = [], [], []
    dk, dv = torch.zeros_like(k, dtype=torch.float64), torch.zeros_like(v, dtype=torch.float64)
    for i in range(h):
        j = i // (h // hk)
        leaves = [t.double().requires_grad_() for t in (q[:, i:i + 1], k[:, j:j + 1], v[:, j:j + 1],
                                                        log_f[:, i:i + 1])]
        out = reference(*leaves[:3], cu, leaves[3])
        gq, gk, gv, gf = torch.autograd.grad(out, leaves, do[:, i:i + 1].double())
        outs.append(out.detach())
        dqs.append(gq)
        dlfs.append(gf)
        dk[:, j:j + 1] += gk
        dv[:, j:j + 1] += gv
    return [torch.cat(outs, 1), torch.cat(dqs, 1), dk, dv, torch.cat(dlfs, 1)]


def per_head(got: torch.Tensor, want: torch.Tensor) -> list[float]:
    dims = [i for i in range(want.dim()) if i != 1]
    err = torch.linalg.vector_norm(got.double() - want, dim=dims) / torch.linalg.vector_norm(want, dim=dims)
    return err.tolist()


def check_kernel(module: types.ModuleType, case: tuple) -> dict:
    name, n, d, dtype, gates, layout = case
    q, k, v, log_f, cu, do = case_inputs(n, d, dtype, gates, layout)
    leaves = [t.detach().requires_grad_() for t in (q, k, v, log_f)]
    begin = time.perf_counter()
    out = module.fox_attention(*leaves[:3], cu, leaves[3])
    got = [out, *torch.autograd.grad(out, leaves, do)]
    torch.cuda.synchronize()
    seconds = time.perf_counter() - begin
    want = expected(q, k, v, log_f, cu, do)
    errors = {key: per_head(g, w) for key, g, w in zip(("out", "dq", "dk", "dv", "dlogf"), got, want, strict=True)}
    row = {"case": name, "N": n, "D": d, "dtype": str(dtype).removeprefix("torch."), "call_s": round(seconds, 2),
           "max": {key: max(e) for key, e in errors.items()}, "per_head": errors}
    row["passed"] = all(e <= TOL[dtype] for e in row["max"].values())
    return row


def fwd_bwd_ms(fn) -> float:
    fn()  # tunes
    return triton.testing.do_bench(fn, warmup=100, rep=400, return_mode="median")


def timings(modules: dict[str, types.ModuleType], t: int = 16384, d: int = 64, width: int = 2048) -> dict:
    """fwd + bwd ms of each kernel and of SDPA's FlashAttention-2 and cuDNN at one document of t
    tokens (bench/attention.py's inputs: RMS-normalised q, k; gate biases spread over [1, 9])."""
    h = width // d
    gen = torch.Generator(device=DEV).manual_seed(t + d)
    q, k = (F.rms_norm(torch.randn(t, h, d, device=DEV, generator=gen), (d,)).bfloat16() for _ in range(2))
    v, do = (torch.randn(t, h, d, device=DEV, generator=gen).bfloat16() for _ in range(2))
    log_f = F.logsigmoid(torch.linspace(1.0, 9.0, h, device=DEV) + 0.5 * torch.randn(t, h, device=DEV, generator=gen))
    leaves = [x.requires_grad_() for x in (q, k, v, log_f)]
    cu = torch.tensor([0, t], dtype=torch.int32, device=DEV)
    ms = {}
    for name, backend in {"fa2": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}.items():
        def sdpa(backend=backend):
            with sdpa_kernel(backend):
                o = F.scaled_dot_product_attention(*(x.transpose(0, 1)[None] for x in leaves[:3]), is_causal=True)
            return torch.autograd.grad(o, leaves[:3], do.transpose(0, 1)[None])

        ms[name] = fwd_bwd_ms(sdpa)
    for name, module in modules.items():
        ms[name] = fwd_bwd_ms(lambda m=module: torch.autograd.grad(m.fox_attention(*leaves[:3], cu, leaves[3]),
                                                                   leaves, do))
    return {"T": t, "D": d, "H": h, "ms": ms,
            "vs_fa2": {name: ms[name] / ms["fa2"] for name in modules},
            "vs_cudnn": {name: ms[name] / ms["cudnn"] for name in modules}}


def kernel_part(before: Path | None) -> dict:
    modules = {"ours": load_kernel(None)} | ({"before": load_kernel(before)} if before else {})
    rows = []
    for label, module in modules.items():
        for case in CASES if label == "ours" else CASES[:BEFORE_CASES]:
            row = {"kernel": label} | check_kernel(module, case)
            rows.append(row)
            print(f"{label:<7} {row['case']:<44} {row['call_s']:>6.1f}s  " + "  ".join(
                f"{key} {x:.1e}" for key, x in row["max"].items()) + ("" if row["passed"] else "   FAILED"), flush=True)
            torch.cuda.empty_cache()
    speed = timings(modules)
    print(f"fwd+bwd at T={speed['T']}, D={speed['D']}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in speed["ms"].items())
          + "; vs fa2 " + ", ".join(f"{k} {v:.2f}x" for k, v in speed["vs_fa2"].items()), flush=True)
    return {"rows": rows, "speed": speed, "passed": all(r["passed"] for r in rows if r["kernel"] == "ours")}


# --- training --------------------------------------------------------------------------------

def layer_of(name: str) -> str:
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" else parts[0]


def one_step(backend: str, cfg, data: PackedDataset, samples: list[int], run: RunParams) -> tuple[float, dict]:
    """The loss and every parameter's gradient of one step, as the training loop computes them."""
    par = Parallel(device=DEV)
    model = prepare(build(cfg, backend, seed=run.seed, device=DEV), run, par)
    batch = make_batch(data, samples, DEV)
    with autocast(model, DEV):
        loss = model(batch.ids, batch.cu_seqlens.tolist(), labels=batch.labels, loss_chunk=run.loss_chunk) / batch.valid
        loss.backward()
    return float(loss.detach()), {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}


def training_part(data_dir: Path, steps: int, work: Path) -> dict:
    train_data, val_data = (PackedDataset(data_dir / part) for part in ("train", "val"))
    cfg = preset("fox-125m", "fox", train_data.seq_len).model_copy(
        update={"vocab_size": int(train_data.index["vocab_size"])})
    # eager blocks: compiled ones took flex's compilation past 300 s on an H200 (2026-11-26) before the
    # first step; the arithmetic (bf16 copies over fp32 masters, chunked loss) is the loop's either way
    run = RunParams(steps=steps, micro_batch=2, lr=1e-3, lr_min=1e-4, warmup=0.05, checkpoint_every=steps,
                    keep_last=1, compile=False)
    samples = (0, 1)
    docs = sum(len(train_data[i].doc_lens) for i in samples)
    losses, grads = {}, {}
    for backend in ("fox", "flex"):  # fox first: its first backward is the autotuned one
        begin = time.perf_counter()
        losses[backend], grads[backend] = one_step(backend, cfg, train_data, samples, run)
        print(f"{backend}: one step in {time.perf_counter() - begin:.0f} s (compiling and tuning)", flush=True)
        torch.cuda.empty_cache()
    per_param = {}
    for name, g in grads["fox"].items():
        w = grads["flex"][name]
        per_param[name] = {"cosine": F.cosine_similarity(g.flatten(), w.flatten(), dim=0, eps=1e-30).item(),
                           "norm_ratio": (g.norm() / w.norm()).item()}
    per_layer = {}
    for name, c in per_param.items():
        per_layer.setdefault(layer_of(name), []).append(c["cosine"])
    gates = {n: c["cosine"] for n, c in per_param.items() if "fgate" in n}
    step = {"tokens": 2 * train_data.seq_len, "documents": docs, "loss": losses,
            "loss_rel_diff": abs(losses["fox"] / losses["flex"] - 1),
            "min_cosine_per_layer": {k: min(v) for k, v in per_layer.items()},
            "fgate_cosine": gates, "per_param": per_param}
    worst = min(per_param.items(), key=lambda kv: kv[1]["cosine"])
    print(f"one step, {step['tokens']} tokens in {docs} documents: loss fox {losses['fox']:.5f} flex "
          f"{losses['flex']:.5f}; lowest gradient cosine {worst[1]['cosine']:.5f} ({worst[0]}); fgate cosines "
          f"{min(gates.values()):.5f} .. {max(gates.values()):.5f}", flush=True)
    for layer, c in step["min_cosine_per_layer"].items():
        print(f"  {layer:<12} min cosine {c:.5f}")

    trained = {}
    for backend in ("fox", "flex"):
        model = build(cfg, backend, seed=run.seed, device=DEV)
        begin = time.perf_counter()
        last = train(model, train_data, run, work / backend, resume=False)
        trained[backend] = {"train_loss_last": last["loss"], "val_loss": mean_loss(model, val_data, len(val_data)),
                            "seconds": time.perf_counter() - begin, "tokens_per_s": last["tokens_per_s"]}
        print(f"{backend}: {steps} steps in {trained[backend]['seconds']:.0f} s, last loss {last['loss']:.4f}, "
              f"val loss {trained[backend]['val_loss']:.4f}", flush=True)
        del model
        torch.cuda.empty_cache()
    val_diff = trained["fox"]["val_loss"] / trained["flex"]["val_loss"] - 1
    passed = (min(c["cosine"] for c in per_param.values()) >= MIN_COSINE and step["loss_rel_diff"] <= 1e-3
              and abs(val_diff) <= 5e-3)
    print(f"val loss fox / flex - 1 = {val_diff:+.4%}; training check {'passed' if passed else 'FAILED'}")
    return {"shape": "fox-125m", "vocab_size": cfg.vocab_size, "seq_len": train_data.seq_len, "step": step,
            "steps": steps, "trained": trained, "val_rel_diff": val_diff, "passed": passed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", nargs="+", default=["kernel", "training"], choices=["kernel", "training"])
    ap.add_argument("--before", type=Path, help="a kernel.py of another commit to check beside ours")
    ap.add_argument("--data", type=Path, help="a packed split (data/packed/<split>) for the training part")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--work", type=Path, default=Path("bench/work/fox_check"))
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    if "training" in args.parts and args.data is None:
        ap.error("--data: the training part needs a packed split")
    result = {"triton": triton.__version__}
    name = "fox_check" if len(set(args.parts)) == 2 else f"fox_check_{args.parts[0]}"
    # training first: the kernel part's timing tunes the shape (16K, D 64, no GQA) that training's
    # first backward must tune itself
    if "training" in args.parts:
        result["training"] = training_part(args.data, args.steps, args.work)
        write_result(args.out, name, result, quiet=True)  # kept if the kernel part is cut
    if "kernel" in args.parts:
        result["kernel"] = kernel_part(args.before)
    write_result(args.out, name, result)
    if not all(part["passed"] for key, part in result.items() if key != "triton"):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
