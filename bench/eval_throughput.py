"""Eval throughput on one GPU at the gpu-64k profile's model shape (~100M, 8,192-token
vocabulary): prompts/s of the eval stage's greedy decoding at 4K-64K prompts, ours decoding the
prompts of a batch together (`eval.batch_tokens`) against ours one prompt at a time and against
transformers' generate on the HF export of the same weights (the peer, same run, its prompts
left-padded into batches of --peer-batch); the prefill alone as prefill tokens/s and as a fraction
of the GPU's dense bf16 peak (2 FLOPs per non-embedding parameter per token plus causal
attention, as the training MFU counts); FoX (Pro) with ours beside. Random weights (speed does
not depend on them); the answers of every mode are compared with batched ours. The tasks and
depths are the gpu-64k profile's eval; `--without draft shared-prefix` times ours also without the
guessed tokens a decode step (model/decode.py's prompt lookup), without the prompts' common prefixes
prefilled once (every prompt whole), without the prompts batched in the order of their ids (those
that begin alike together), without bf16 weights (fp32 ones under autocast: suite.inference_weights)
or without the fused RMSNorm, rotary and SwiGLU kernels (model/fused.py; its prefill timed too), in
the same run, and compares their answers. `--checkpoint` scores a trained checkpoint's weights instead
(what ACP skips depends on the trained gates) and `--acp-eps` times FoX also with its prompts' prefill
pruned by ACP (eval.acp_eps).

    python bench/eval_throughput.py --tokenizer data/tokens/tokenizer
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
from pathlib import Path

import torch

from longctx import config
from longctx.data.tokenizer import TextTokenizer
from longctx.eval import needle, suite
from longctx.model import decode, fused
from longctx.model.config import FoxConfig
from longctx.model.fox import Acp
from longctx.model.hf import save_hf
from longctx.model.transformer import Transformer
from longctx.perf import write_result
from longctx.train.flops import flop_params, peak_flops
from longctx.train.models import build, load_model

EVAL = config.resolve({"profile": "gpu-64k"}).eval
SWITCHES = {"shared-prefix": (decode, "SHARED_PREFIX", False), "draft": (decode, "DRAFT_TOKENS", 0),
            "fused": (fused, "FUSED", False)}
"""--without: the module switch each names, and its value when off (alike-order: a length's
prompts batched longest first, not in the order of their ids; bf16-weights: an fp32 copy of the model)."""
OTHERS = ["alike-order", "bf16-weights"]


def model(fox: bool, vocab: int, window: int, checkpoint: Path | None) -> Transformer:
    if checkpoint is not None:
        return load_model(checkpoint).cuda().eval()
    params = config.resolve({"profile": "gpu-64k"}).model
    cfg = params.as_model_config(vocab).model_copy(update={"max_position_embeddings": window})
    if fox:
        cfg = cfg.model_copy(update={"rope": None, "fox": FoxConfig()})
    return build(cfg, device="cuda").eval()


def prefill_flops(m: Transformer, lengths: list[int]) -> float:
    """A forward's FLOPs over these prompts: 2 per non-embedding parameter per token plus the
    two matmuls of causal attention over each prompt's lower triangle."""
    c = m.cfg
    return sum(2 * flop_params(m) * n + 2 * c.n_layers * c.n_heads * c.dim_head * n * n for n in lengths)


def kernels(m: Transformer, encoded: list[list[int]], budget: int, top: int = 8) -> list[dict]:
    """The prefill's CUDA kernels by their share of its GPU time (one pass under the profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        prefill(m, encoded, budget)
    return kernel_rows([e for e in prof.key_averages() if e.device_time_total > 0], top)


def kernel_rows(events: list, top: int) -> list[dict]:
    """The `top` kernels of profiler events by their share of the kernels' GPU time."""
    total = sum(e.device_time_total for e in events)
    events = sorted(events, key=lambda e: -e.device_time_total)
    return [{"kernel": e.key[:90], "calls": e.count, "share": round(e.device_time_total / total, 4),
             "ms": round(e.device_time_total / 1e3, 2)} for e in events[:top]]


def show_kernels(rows: list[dict]) -> None:
    for k in rows:
        print(f"  {k['share']:>6.1%} {k['ms']:>9.1f} ms {k['calls']:>6}  {k['kernel']}")


SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")


def decode_profile(answer: suite.Answerer, enc: suite.Encoder, prompts, encoded, budget: int,
                   top: int = 8) -> dict:
    """Where a length's whole answering time goes (prefill and decode steps, one pass under the
    profiler): the GPU's kernel time against the wall time (the rest is the GPU waiting for the
    host), kernel launches and host syncs, and the kernels by their share. The profiler's own
    cost inflates the wall time, so `busy` is a lower bound."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        stats, _ = timed(answer, enc, prompts, encoded, budget)
    events = prof.key_averages()
    on_gpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0]
    gpu = sum(e.device_time_total for e in on_gpu) / 1e6
    count = {e.key: e.count for e in events}
    return {"seconds": stats["seconds"], "kernel_seconds": round(gpu, 3),
            "busy": round(gpu / stats["seconds"], 3),
            "launches": sum(count.get(k, 0) for k in LAUNCHES), "syncs": sum(count.get(k, 0) for k in SYNCS),
            "argmax_reads": count.get("aten::argmax", 0),  # a step each (and the prefill's)
            "kernels": kernel_rows(on_gpu, top)}


@torch.no_grad()
def prefill(m: Transformer, encoded: list[list[int]], budget: int) -> float:
    """Seconds of the prefills alone (each batch's prompts packed, the head on each last row), as
    the eval batches them."""
    order = sorted(range(len(encoded)), key=lambda i: -len(encoded[i]))
    runs = [[encoded[order[j]] for j in run] for run in needle.groups([len(encoded[i]) for i in order], budget)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for batch in runs:
        ids = torch.tensor([t for p in batch for t in p], device="cuda")
        bounds = [0]
        for p in batch:
            bounds.append(bounds[-1] + len(p))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            m.lm_head(m.hidden(ids, bounds)[torch.tensor(bounds[1:], device="cuda") - 1])
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def hf_batched(folder: Path, eos: int | None, batch: int) -> suite.Answerer:
    """transformers' generate, the prompts left-padded into batches of `batch` (its attention
    mask and positions skip the padding)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).cuda().eval()
    pad = eos or 0

    @torch.no_grad()
    def answer(prompts: list[list[int]], max_new: list[int]) -> list[list[int]]:
        outs = []
        for i in range(0, len(prompts), batch):
            group, top = prompts[i:i + batch], max(len(p) for p in prompts[i:i + batch])
            x = torch.tensor([[pad] * (top - len(p)) + p for p in group], device="cuda")
            mask = torch.tensor([[0] * (top - len(p)) + [1] * len(p) for p in group], device="cuda")
            out = hf.generate(x, attention_mask=mask, max_new_tokens=max(max_new[i:i + batch]), do_sample=False,
                              eos_token_id=eos, pad_token_id=pad)
            outs += [o[top:top + n].tolist() for o, n in zip(out, max_new[i:i + batch], strict=True)]
        return outs

    return answer


def timed(answer: suite.Answerer, enc: suite.Encoder, prompts, encoded, budget: int,
          alike: bool = True) -> tuple[dict, list[str]]:
    """Ours batches a length's prompts as the eval does (`alike`: in the order of their ids), the
    others longest first."""
    answer([encoded[0][:256]], [2])  # warm-up (kernels, allocator)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    part = (prompts, encoded, suite.alike_first(encoded)) if alike else suite.part(prompts, encoded)
    rows, _ = suite.run_tasks(answer, enc, [part], "bench", budget)
    torch.cuda.synchronize()
    sec = time.perf_counter() - t0
    return {"prompts": len(prompts), "seconds": round(sec, 3), "prompts_per_s": round(len(prompts) / sec, 3),
            "mean_score": round(sum(r["score"] for r in rows) / len(rows), 3)}, [r["output"] for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path("bench/results/eval-throughput"),
                       help="folder of the JSON (<benchmark>-<device>-<date>.json)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 32768, 65536])
    parser.add_argument("--per-task", type=int, default=4, help="prompts per task and length")
    parser.add_argument("--batch-tokens", type=int, default=65536, help="ours: prompt tokens a batch")
    parser.add_argument("--peer-batch", type=int, default=4, help="transformers: prompts a generate call")
    parser.add_argument("--peer-lengths", type=int, nargs="*", default=[4096, 16384],
                        help="lengths to time transformers at (it is the slow one)")
    parser.add_argument("--models", nargs="+", choices=["transformer", "fox"], default=["transformer", "fox"])
    parser.add_argument("--alone", action=argparse.BooleanOptionalAction, default=True,
                        help="time ours one prompt at a time too")
    parser.add_argument("--attention", default="auto", help="ours: the attention backend (model.attention_backend)")
    parser.add_argument("--profile", action="store_true",
                        help="the prefill's top CUDA kernels, and the whole answering's (its kernel time against "
                        "the wall, launches, syncs), each length")
    parser.add_argument("--tasks", nargs="+", default=list(EVAL.tasks), help="default: the gpu-64k profile's")
    parser.add_argument("--depths", type=float, nargs="+", default=list(EVAL.depths),
                        help="needle depths, cycling over a task's prompts (default: the gpu-64k profile's)")
    parser.add_argument("--without", nargs="*", choices=sorted(SWITCHES) + OTHERS, default=["draft"],
                        help="ours: also timed with each of these off (its answers compared with the default's)")
    parser.add_argument("--checkpoint", type=Path, help="a trained checkpoint's weights (--models: its architecture)")
    parser.add_argument("--acp-eps", type=float, help="FoX: also timed with the prefill pruned by ACP at this eps")
    args = parser.parse_args()
    tok = TextTokenizer.load(args.tokenizer)
    enc = suite.Encoder(tok, chat=False)
    vocab = max(tok.vocab_size, 8192)
    window = max(args.lengths)
    peak = peak_flops(torch.device("cuda"))
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for fox in [m == "fox" for m in args.models]:
            m = model(fox, vocab, window, args.checkpoint)
            if args.checkpoint is not None and (m.cfg.fox is not None) != fox:
                parser.error(f"--checkpoint {args.checkpoint} is {'not ' * (not fox)}a FoX model: give --models "
                             f"{'transformer' if fox else 'fox'}")
            m.attention_backend = args.attention
            name = "FoX (Pro)" if fox else "Transformer"
            if not fox:
                save_hf(m, Path(d) / "hf", args.tokenizer)
            fp32 = copy.deepcopy(m) if "bf16-weights" in args.without else None
            suite.inference_weights(m)
            for length in args.lengths:
                t0 = time.perf_counter()  # the eval stage builds and encodes its prompts once, on the host
                prompts = suite.build_prompts(enc, args.tasks, [length], args.per_task, args.depths, 0, haystack())
                encoded = enc.prompts(prompts)
                build = time.perf_counter() - t0
                ours = suite.our_answerer(m, enc.eos())
                prefill(m, encoded, args.batch_tokens)  # warm-up: each length's kernels (FoX tunes per length)
                seconds = prefill(m, encoded, args.batch_tokens)
                flops = prefill_flops(m, [len(e) for e in encoded])
                row = {"model": name, "length": length, "prompts": len(prompts),
                       "prompt_tokens": sum(map(len, encoded)), "build_seconds": round(build, 3),
                       "prefill_seconds": round(seconds, 3),
                       "prefill_tokens_per_s": round(sum(map(len, encoded)) / seconds),
                       "prefill_flop_fraction": round(flops / seconds / peak, 4) if peak else None}
                if args.profile:
                    row["kernels"] = kernels(m, encoded, args.batch_tokens)
                    show_kernels(row["kernels"])
                    row["answering"] = decode_profile(ours, enc, prompts, encoded, args.batch_tokens)
                    print({k: v for k, v in row["answering"].items() if k != "kernels"})
                    show_kernels(row["answering"]["kernels"])
                row["batched"], want = timed(ours, enc, prompts, encoded, args.batch_tokens)
                for switch in args.without:
                    module, attr, off = SWITCHES.get(switch, (None, None, None))
                    saved = getattr(module, attr) if attr else None
                    if attr:
                        setattr(module, attr, off)
                    try:
                        answer = suite.our_answerer(fp32, enc.eos()) if switch == "bf16-weights" else ours
                        row[f"without_{switch}"], got = timed(answer, enc, prompts, encoded, args.batch_tokens,
                                                              alike=switch != "alike-order")
                        if switch == "fused":
                            off_s = prefill(m, encoded, args.batch_tokens)
                            row["without_fused"].update(prefill_seconds=round(off_s, 3),
                                                        prefill_flop_fraction=round(flops / off_s / peak, 4)
                                                        if peak else None)
                    finally:
                        if attr:
                            setattr(module, attr, saved)
                    row[f"without_{switch}"]["same_answers"] = sum(a == b for a, b in zip(got, want, strict=True))
                    row[f"vs_without_{switch}"] = round(row["batched"]["prompts_per_s"]
                                                        / row[f"without_{switch}"]["prompts_per_s"], 2)
                if fox and args.acp_eps:
                    m.acp = Acp(args.acp_eps)
                    row["with_acp"], got = timed(ours, enc, prompts, encoded, args.batch_tokens)
                    row["with_acp"].update(pruned=round(m.acp.stats.pruned_fraction(), 4),
                                           same_answers=sum(a == b for a, b in zip(got, want, strict=True)))
                    m.acp = None
                    row["acp_speedup"] = round(row["with_acp"]["prompts_per_s"] / row["batched"]["prompts_per_s"], 2)
                if args.alone:
                    row["one_at_a_time"], got = timed(ours, enc, prompts, encoded, 1)
                    row["one_at_a_time"]["same_answers"] = sum(a == b for a, b in zip(got, want, strict=True))
                    row["vs_one_at_a_time"] = round(row["batched"]["prompts_per_s"]
                                                    / row["one_at_a_time"]["prompts_per_s"], 2)
                if not fox and length in args.peer_lengths:
                    peer = hf_batched(Path(d) / "hf", enc.eos(), args.peer_batch)
                    row["transformers"], got = timed(peer, enc, prompts, encoded, 1 << 30)
                    row["transformers"]["same_answers"] = sum(a == b for a, b in zip(got, want, strict=True))
                    row["vs_transformers"] = round(row["batched"]["prompts_per_s"]
                                                   / row["transformers"]["prompts_per_s"], 2)
                    del peer
                rows.append(row)
                print(row, flush=True)
            del m
            torch.cuda.empty_cache()
    offs = "".join(f" {'no ' + w:>16} {'x':>5}" for w in args.without) + (" ACP prompts/s  skipped    x" if args.acp_eps
                                                                          else "")
    print(f"{'model':<12} {'length':>7} {'prompts/s':>10}{offs} {'1-at-a-time':>11} "
          f"{'transformers':>12} {'x HF':>5} {'prefill tok/s':>13} {'of peak':>7} {'build s':>7}")
    for r in rows:
        peer = r.get("transformers", {}).get("prompts_per_s", "-")
        alone = r.get("one_at_a_time", {}).get("prompts_per_s", "-")
        offs = "".join(f" {r[f'without_{w}']['prompts_per_s']:>16} {r[f'vs_without_{w}']:>5}" for w in args.without)
        if args.acp_eps:
            acp = r.get("with_acp", {})
            offs += f" {acp.get('prompts_per_s', '-'):>13} {acp.get('pruned', '-'):>8} {r.get('acp_speedup', '-'):>4}"
        print(f"{r['model']:<12} {r['length']:>7} {r['batched']['prompts_per_s']:>10}{offs} {alone:>11} "
              f"{peer:>12} {r.get('vs_transformers', '-'):>5} "
              f"{r['prefill_tokens_per_s']:>13} {r['prefill_flop_fraction']:>7} {r['build_seconds']:>7}")
    write_result(args.out, "eval_throughput", {"shape": "gpu-64k model (d768, 12 layers)", "tasks": args.tasks,
                                                "depths": args.depths, "per_task": args.per_task,
                                                "batch_tokens": args.batch_tokens, "peer_batch": args.peer_batch,
                                                "attention": args.attention, "acp_eps": args.acp_eps,
                                                "checkpoint": str(args.checkpoint) if args.checkpoint else None,
                                                "rows": rows})


def haystack() -> str:
    return "A long text about nothing in particular, repeated to make a haystack. " * 50


if __name__ == "__main__":
    main()
