"""Whose are cuDNN's wrong attention gradients, cuDNN's or our wrapper's (issues 32, 34)?

On the trained gpu-64k base our cuDNN path's q/k gradients were uncorrelated with every other
backend's (bench/backend_grads.py), so 'cudnn' is refused, and the Transformer baselines run
FlashAttention-2 at ~2/3 of cuDNN's speed. Random unit inputs pass the wrapper
(tests/test_gpu_attention.py). This times nothing: it computes one attention op's output and
q/k/v gradients, in bf16, in four ways on the same documents and the same upstream gradient, each
against the fp64 reference (relative error by norm):

  wrapper      model/cudnn_attention.py (documents of >= LONG_DOC tokens dense cuDNN, padded to a
               plan size; the rest FlashAttention-2)
  torch_cudnn  PyTorch's own cuDNN path: per document F.scaled_dot_product_attention under
               sdpa_kernel(CUDNN_ATTENTION), autograd's backward
  varlen       FlashAttention-2's varlen kernel (the backend the Transformer trains with)

in input regimes a trained model is in and random unit inputs are not: `peaked` (logits of std
~8, as induction heads have them), `sinks` (peaked, and most of every row's weight on its
document's first token, as trained LMs put it), `tiny-base` (q, k, v and the loss's gradient
at the attention output of checkpoints/tiny-base's layers on this repository's text), beside
`unit`. If torch_cudnn matches the reference where the wrapper does not, the wrapper is wrong;
if both fail, cuDNN is (PyTorch issue #150700). They run in one process, in --order (default:
the wrapper, PyTorch's path, FlashAttention-2, the wrapper again): PyTorch caches cuDNN's graphs
keyed by q/k/v sizes and strides alone but builds the output gradient's strides into the backward
graph, so a second caller of one key with another gradient layout runs the first's graph.
--shared-keys takes away the batch stride that keeps the wrapper's graphs its own (as it was
before issue 32's fix) to show that collision: `--regimes tiny-base --order torch_cudnn wrapper`.

    python bench/cudnn_grads.py --out bench/results        (one CUDA GPU, about a minute)
    python bench/cudnn_grads.py --heads 32 8 --lengths 8192 4096 37 4096 900 --regimes unit peaked sinks
                                (the 8B's heads over documents as the gpu-64k base saw them)
    python bench/cudnn_grads.py --regimes tiny-base --order torch_cudnn wrapper [--shared-keys]
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from longctx.data.tokenizer import TextTokenizer
from longctx.model import attention, cudnn_attention
from longctx.perf import write_result
from longctx.train.models import load_model

REPO = Path(__file__).resolve().parent.parent
BASE = REPO / "checkpoints" / "tiny-base"
STDLIB = Path(os.__file__).parent
LENGTHS = [2600, 37, 1400, 59, 1400, 700]
"""Documents past LONG_DOC beside short ones, two of one length (one cached cuDNN graph)."""
REGIMES = ("unit", "peaked", "sinks")
"""The synthetic input regimes (`tiny-base` is captured from a checkpoint)."""
Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
"""q [N, H, D], k and v [N, Hkv, D], the upstream gradient [N, H, D] (all fp32), cu_seqlens."""


def boundaries(lengths: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def synthetic(regime: str, lengths: list[int], heads: tuple[int, int], d: int, device: torch.device,
              seed: int = 0) -> Inputs:
    """`unit`, `peaked` or `sinks` inputs over documents of these lengths (heads: query, KV)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    n, (h, hk) = sum(lengths), heads
    q, k, v, g = (torch.randn(n, x, d, generator=gen, device=device) for x in (h, hk, hk, h))
    cu = boundaries(lengths, device)
    if regime in ("peaked", "sinks"):
        q, k = 2.8 * q, 2.8 * k  # q.k / sqrt(d) of std 2.8^2 ~ 8 at any d
    if regime == "sinks":  # every query leans on one direction that its document's first key holds
        u = F.normalize(torch.randn(d, generator=gen, device=device), dim=0)
        q = q + 4.0 * u
        k[cu[:-1].long()] += 30 * math.sqrt(d) / 4.0 * u  # q_i.k_first / sqrt(d) ~ 30, the others' std ~ 8
    elif regime not in REGIMES:
        raise ValueError(f"regime {regime!r} is not unit, peaked or sinks")
    return q, k, v, g, cu


def captured(base: Path, lengths: list[int], device: torch.device, layer: int) -> Inputs:
    """q, k, v (after the rotary) and the gradient of the summed next-token loss at the attention
    output of one layer of a trained checkpoint, on the standard library's Python sources (the first
    40 top-level modules, sorted: text that does not change as this repository does), one file a
    document, cut to `lengths` tokens (fp32 forward)."""
    tok = TextTokenizer.load(base)
    texts = [p.read_text(errors="replace") for p in sorted(STDLIB.glob("*.py"))[:40]]   # (enough for any few lengths)
    docs = [d for d in tok.encode_texts(texts, add_bos=True, add_eos=False) if len(d) >= max(lengths)]
    if not docs:
        raise ValueError(f"no source file of {max(lengths)} tokens under {STDLIB}")
    ids = torch.cat([torch.as_tensor(docs[i % len(docs)][:length], dtype=torch.long)
                     for i, length in enumerate(lengths)]).to(device)
    cu = boundaries(lengths, device)
    model = load_model(base, "sdpa").to(device).float()
    calls: list[int] = []
    seen: dict[str, torch.Tensor] = {}
    plain = attention.BACKENDS["sdpa"]

    def record(q, k, v, cu_seqlens, log_f=None, scale=None):
        out = plain(q, k, v, cu_seqlens, log_f, scale)
        if len(calls) == layer:  # the layers attend in order, once each
            seen.update(q=q.detach(), k=k.detach(), v=v.detach())
            out.register_hook(lambda grad: seen.__setitem__("g", grad.detach()))
        calls.append(1)
        return out

    attention.BACKENDS["sdpa"] = record
    try:
        labels = torch.cat((ids[1:], ids.new_full((1,), -100)))
        labels[cu[1:-1].long() - 1] = -100  # no loss across a document boundary
        model(ids, cu, labels=labels).backward()
    finally:
        attention.BACKENDS["sdpa"] = plain
    if "g" not in seen:
        raise ValueError(f"{base}: no layer {layer} (the model has {len(calls)})")
    return seen["q"], seen["k"], seen["v"], seen["g"], cu


def torch_cudnn(q, k, v, cu_seqlens, scale=None):
    """PyTorch's cuDNN attention per document, autograd's backward; routed as the wrapper routes
    (documents under cudnn_attention.long_doc to FlashAttention-2), so the two differ only in the glue."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    bounds, outs = cu_seqlens.tolist(), []
    groups = q.shape[1] // k.shape[1]
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        qd, kd, vd = (t[a:b].transpose(0, 1)[None] for t in (q, k, v))
        if groups > 1:
            kd, vd = kd.repeat_interleave(groups, 1), vd.repeat_interleave(groups, 1)
        long = b - a >= cudnn_attention.long_doc(q.shape[1] * q.shape[2])
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION if long else SDPBackend.FLASH_ATTENTION]):
            outs.append(F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale)[0].transpose(0, 1))
    return torch.cat(outs)


VARIANTS: dict[str, Callable] = {"wrapper": cudnn_attention.attend, "torch_cudnn": torch_cudnn,
                                 "varlen": attention.varlen}
ORDER = ["wrapper", "torch_cudnn", "varlen", "wrapper"]
"""The wrapper again after PyTorch's path has filled cuDNN's graph caches."""


def ordered(names: list[str]) -> dict[str, Callable]:
    """The variants in this order, a repeat labelled by its count (wrapper, ..., wrapper_2)."""
    out: dict[str, Callable] = {}
    for i, name in enumerate(names):
        seen = names[:i].count(name)
        out[f"{name}_{seen + 1}" if seen else name] = VARIANTS[name]
    return out


def errors(inputs: Inputs, variants: dict[str, Callable], dtype: torch.dtype = torch.bfloat16) -> dict[str, dict]:
    """Per variant: relative error by norm of out, dq, dk, dv against the fp64 reference, and the
    cosine of each gradient with the reference's; a variant that raises gets its error message."""
    q, k, v, g, cu = inputs
    ref, ref_grads = fp64_reference(q, k, v, g, cu)
    probs = attention_weights(q.double(), k.double(), cu)
    rows = {"_inputs": {"tokens": q.shape[0], "heads": [q.shape[1], k.shape[1]], "head_dim": q.shape[2],
                        "top_weight": round(float(probs.amax(-1).mean()), 4),
                        "first_token_weight": round(float(probs[..., 0].mean()), 4)}}
    for name, fn in variants.items():
        leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
        try:
            out = fn(*leaves, cu)
            grads = torch.autograd.grad(out, leaves, g.to(out.dtype))
        except Exception as e:  # a refused shape is a finding, not a crash of the others
            rows[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
            continue
        row = {"out": rel(out, ref)}
        for which, a, b in zip("qkv", grads, ref_grads, strict=True):
            row[f"d{which}"] = rel(a, b)
            row[f"cos_d{which}"] = round(F.cosine_similarity(a.double().flatten(), b.flatten(), dim=0).item(), 5)
        rows[name] = row
    return rows


def fp64_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   cu: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """out and (dq, dk, dv) in fp64, one document and one KV head (with its query heads) at a time:
    document masking makes attention block-diagonal, and a dense [H, N, N] over 8B-shaped heads and
    thousands of tokens would not fit (32 heads x 16K tokens: 69 GB a copy)."""
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    grads = tuple(torch.zeros(t.shape, dtype=torch.float64, device=q.device) for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    bounds = cu.tolist()
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        one = torch.tensor([0, b - a], dtype=cu.dtype, device=cu.device)
        for j in range(k.shape[1]):
            spans = (slice(j * groups, (j + 1) * groups), slice(j, j + 1), slice(j, j + 1))  # q, k, v heads
            leaves = [t[a:b, span].detach().double().requires_grad_(True)
                      for t, span in zip((q, k, v), spans, strict=True)]
            o = attention.reference(*leaves, one)
            parts = torch.autograd.grad(o, leaves, g[a:b, spans[0]].double())
            for full, span, part in zip(grads, spans, parts, strict=True):
                full[a:b, span] = part
            out[a:b, spans[0]] = o.detach()
    return out, grads


def attention_weights(q: torch.Tensor, k: torch.Tensor, cu: torch.Tensor, rows: int = 64) -> torch.Tensor:
    """The attention weights of the last `rows` queries of the longest document, their keys being
    its tokens from its first [H, rows, L]: how peaked a regime is, and how much its first token takes."""
    bounds = cu.tolist()
    a, b = max(zip(bounds[:-1], bounds[1:], strict=True), key=lambda ab: ab[1] - ab[0])
    kd = k[a:b].repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    qd = q[max(a, b - rows):b]
    logits = torch.einsum("qhd,khd->hqk", qd, kd) / math.sqrt(q.shape[-1])
    pos = torch.arange(b - a, device=q.device)
    logits = logits.masked_fill(pos[None, None, :] > (pos[-qd.shape[0]:])[None, :, None], float("-inf"))
    return logits.softmax(-1)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return round(((a.double() - b.double()).norm() / b.double().norm()).item(), 5)


def table(results: dict[str, dict]) -> str:
    lines = [f"{'regime':<10} {'variant':<20} {'out':>8} {'dq':>8} {'dk':>8} {'dv':>8} {'cos dq':>8} {'cos dk':>8}"]
    for regime, rows in results.items():
        info = rows["_inputs"]
        lines.append(f"{regime:<10} (top weight {info['top_weight']}, first token {info['first_token_weight']})")
        for name, row in rows.items():
            if name == "_inputs":
                continue
            if "error" in row:
                lines.append(f"{'':<10} {name:<20} {row['error'][:60]}")
                continue
            lines.append(f"{'':<10} {name:<20} {row['out']:>8.4f} {row['dq']:>8.4f} {row['dk']:>8.4f} "
                         f"{row['dv']:>8.4f} {row['cos_dq']:>8.4f} {row['cos_dk']:>8.4f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--heads", type=int, nargs=2, default=[8, 2], help="query and KV heads (the 8B's ratio)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--lengths", type=int, nargs="+", default=LENGTHS, help="the synthetic regimes' documents")
    ap.add_argument("--long-doc", type=int, default=1024, help="documents of at least this many tokens take cuDNN "
                    "in the synthetic regimes (the model's rule, cudnn_attention.long_doc, sends fewer: 2,048 tokens "
                    "and up at 32 x 128)")
    ap.add_argument("--regimes", nargs="+", default=[*REGIMES, "tiny-base"], choices=[*REGIMES, "tiny-base"])
    ap.add_argument("--base", type=Path, default=BASE, help="a trained checkpoint for the tiny-base regime")
    ap.add_argument("--layer", type=int, default=3, help="the tiny base's most peaked layer (top weight 0.29)")
    ap.add_argument("--order", nargs="+", default=ORDER, choices=list(VARIANTS), help="the variants, run in this "
                    "order in one process (a name may repeat)")
    ap.add_argument("--shared-keys", action="store_true", help="the wrapper's tensors without a batch stride of "
                    "their own, as before issue 32's fix: PyTorch's path and the wrapper share cached cuDNN graphs")
    args = ap.parse_args()
    if min(args.lengths) < 1 or args.long_doc < 1:
        ap.error(f"--lengths {args.lengths} and --long-doc {args.long_doc}: token counts of at least 1")
    if args.heads[1] < 1 or args.heads[0] % args.heads[1]:
        ap.error(f"--heads {args.heads}: the query heads must be a multiple of the KV heads")
    if not torch.cuda.is_available():
        raise SystemExit("cudnn_grads: needs a CUDA GPU (cuDNN's attention and FlashAttention-2)")
    dev = torch.device("cuda")
    private = cudnn_attention._private
    variants, results = ordered(args.order), {}
    try:
        if args.shared_keys:
            cudnn_attention._private = lambda t: t
        with cudnn_attention.fixed_long_doc(args.long_doc):
            for r in (r for r in args.regimes if r in REGIMES):
                results[r] = errors(synthetic(r, args.lengths, tuple(args.heads), args.head_dim, dev), variants)
        if "tiny-base" in args.regimes:  # trained at 512 tokens: documents within it, routed to cuDNN from 128
            with cudnn_attention.fixed_long_doc(128):
                results["tiny-base"] = errors(captured(args.base, [512, 37, 300, 512, 90, 450], dev, args.layer),
                                              variants)
    finally:
        cudnn_attention._private = private
    print(table(results))
    write_result(args.out, "cudnn_grads", {"lengths": args.lengths, "long_doc": args.long_doc, "heads": args.heads,
                                           "head_dim": args.head_dim, "cudnn": torch.backends.cudnn.version(),
                                           "order": args.order, "shared_keys": args.shared_keys,
                                           "regimes": results})


if __name__ == "__main__":
    main()
