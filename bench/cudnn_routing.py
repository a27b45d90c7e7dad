"""Which documents pay for a cuDNN call of their own. The 'cudnn' backend gives every document
long enough (cudnn_attention.long_doc: length^2 x heads x head dim >= CALL_WORK) a dense cuDNN call
and the rest FlashAttention-2's varlen kernel in one call; under the old rule (every document of
1,024 tokens or more to cuDNN) the product's gpu-64k Llama (12 heads x 64) trained its 4K stages at
0.5-0.65x FlashAttention-2's tokens/s and its 64K stage at 1.34x (2026-11-29): per-call costs (a host
loop, copies of each document's output and gradients, a cuDNN plan per padded length) against
per-call work.

Per head shape (query heads / key-value heads / head dim) and document length L: a packed batch
of --tokens tokens made of documents of L tokens, forward + backward, bf16, the median of
triton's do_bench, of attention.varlen (FlashAttention-2), of attention.cudnn with every document
through cuDNN ("cudnn", and its first call: the plans built) and as routed by CALL_WORK ("routed").
Printed: the table and, per shape, the shortest L from which cuDNN is faster at every longer L
(the crossover), beside the threshold the rule gives.

    python bench/cudnn_routing.py --out bench/results        # on a CUDA machine with cuDNN >= 9
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import triton

from longctx.model import attention, cudnn_attention
from longctx.perf import write_result

SHAPES = ["12/12/64", "16/4/128", "32/8/128"]
"""gpu-64k's Llama; the 8B's heads a rank under Ulysses SP 2; the 8B's on one GPU."""
LENGTHS = [1024, 2048, 4096, 8192, 16384, 32768, 65536]


def parse_shape(text: str) -> tuple[int, int, int]:
    try:
        h, hk, d = (int(x) for x in text.split("/"))
    except ValueError:
        raise SystemExit(f"--shapes {text!r}: give query heads/key-value heads/head dim, e.g. 16/4/128") from None
    if min(h, hk, d) < 1 or h % hk:
        raise SystemExit(f"--shapes {text!r}: query heads must be a positive multiple of key-value heads")
    return h, hk, d


def cases(shapes: list[str], lengths: list[int], tokens: int) -> list[dict]:
    """One case per shape and length that fits `tokens`: its documents' boundaries (whole
    documents only: tokens // L of them)."""
    out = []
    for text in shapes:
        h, hk, d = parse_shape(text)
        for length in lengths:
            if length > tokens:
                continue
            docs = tokens // length
            out.append({"shape": text, "heads": h, "kv_heads": hk, "dim": d, "length": length, "documents": docs,
                        "bounds": list(range(0, docs * length + 1, length))})
    return out


def timed(fn) -> tuple[float, float]:
    """(seconds of the first call, median seconds of later calls: triton's do_bench, as bench/attention.py)."""
    torch.cuda.synchronize()
    begin = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - begin, triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") / 1e3


def run_case(case: dict) -> dict:
    n, dev = case["bounds"][-1], torch.device("cuda")
    gen = torch.Generator(dev).manual_seed(0)
    q = torch.randn(n, case["heads"], case["dim"], device=dev, dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(n, case["kv_heads"], case["dim"], device=dev, dtype=torch.bfloat16, generator=gen)
            for _ in range(2))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    cu = torch.tensor(case["bounds"], dtype=torch.int32, device=dev)
    row = {key: val for key, val in case.items() if key != "bounds"}
    width = case["heads"] * case["dim"]
    row["long_doc"] = cudnn_attention.long_doc(width)
    for name, backend, long_doc in (("varlen", "varlen", None), ("cudnn", "cudnn", 128), ("routed", "cudnn", None)):
        with cudnn_attention.fixed_long_doc(long_doc):
            fn, plan = attention.BACKENDS[backend], attention.plan(backend, case["bounds"], dev, width)

        def step(fn=fn, plan=plan):
            out = fn(*leaves, cu, plan=plan)
            out.backward(torch.ones_like(out))
        first, median = timed(step)
        row[f"{name}_ms"], row[f"{name}_first_s"] = round(median * 1e3, 3), round(first, 3)
    row["cudnn_vs_varlen"] = round(row["cudnn_ms"] / row["varlen_ms"], 3)
    row["routed_vs_varlen"] = round(row["routed_ms"] / row["varlen_ms"], 3)
    return row


def crossover(rows: list[dict]) -> int | None:
    """The shortest length from which cuDNN is faster at every longer length measured, or None."""
    best = None
    for r in sorted(rows, key=lambda r: -r["length"]):
        if r["cudnn_vs_varlen"] >= 1.0:
            break
        best = r["length"]
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=SHAPES, help="query heads/key-value heads/head dim")
    ap.add_argument("--lengths", type=int, nargs="+", default=LENGTHS, help="document lengths, each its own case")
    ap.add_argument("--tokens", type=int, default=65536, help="tokens in each packed batch")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    if args.tokens < min(args.lengths) or min(args.lengths) < 128:
        ap.error(f"--lengths: each at least 128 (cuDNN's shortest plan), and --tokens {args.tokens} must hold the "
                 "shortest")
    todo = cases(args.shapes, args.lengths, args.tokens)
    if not torch.cuda.is_available() or "cudnn" not in attention.available(torch.device("cuda")):
        raise SystemExit("cudnn_routing: needs a CUDA GPU with cuDNN >= 9 (sm80+)")
    fields = {"tokens": args.tokens, "call_work": cudnn_attention.CALL_WORK, "rows": []}
    print(f"{'shape':>10} {'L':>6} {'docs':>5} {'varlen ms':>10} {'cudnn ms':>10} {'ratio':>6} {'cudnn 1st s':>11} "
          f"{'routed ms':>10} {'ratio':>6}", flush=True)
    for case in todo:
        row = run_case(case)
        fields["rows"].append(row)
        print(f"{row['shape']:>10} {row['length']:>6} {row['documents']:>5} {row['varlen_ms']:>10.3f} "
              f"{row['cudnn_ms']:>10.3f} {row['cudnn_vs_varlen']:>6.3f} {row['cudnn_first_s']:>11.3f} "
              f"{row['routed_ms']:>10.3f} {row['routed_vs_varlen']:>6.3f}", flush=True)
    fields["crossover"] = {s: crossover([r for r in fields["rows"] if r["shape"] == s]) for s in args.shapes}
    for shape, length in fields["crossover"].items():
        h, _, d = parse_shape(shape)
        print(f"{shape}: cuDNN faster from {length or 'no measured length'}; the rule sends documents from "
              f"{cudnn_attention.long_doc(h * d)} tokens")
    write_result(args.out, "cudnn_routing", fields, quiet=False)


if __name__ == "__main__":
    main()
