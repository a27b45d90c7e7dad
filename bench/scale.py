"""Scale-out training throughput (docs/training-speed.md): full optimizer steps of a large
shape over all ranks with FSDP2, and with Ulysses sequence parallelism, as the training stages run
them (the loop's own `prepare` and `train_step`: FSDP2 with bf16 weights over fp32 masters, AdamW,
activation checkpointing, compiled blocks on CUDA, the chunked loss, document-masked attention).
Launch with torchrun, one process per GPU:

    torchrun --standalone --nproc-per-node 2 bench/scale.py

Settings (--settings):
  fsdp       Llama-3-8B shape, --fsdp-seq tokens (64K) per sequence, --accum sequences per rank
             per step, FSDP2 over all ranks (ProLong stage 1's layout)
  sp         --sp-seq tokens (512K) per sequence, Ulysses over all ranks (ProLong stage 2: SP 8)
  fox-fsdp   the FoX (Pro) variant of the same shape (no RoPE), the `fox` kernel with ACP
  fox-sp     the same with sequence parallelism
--offload keeps parameters, gradients and optimizer state in host memory (FSDP2 CPU offload);
--offload-activations full recomputation's block inputs (--offload-keep-last N: all but the last N
blocks'); --mlp-tile N runs the MLP N tokens at a time.
Data: generated packed sequences (random tokens): documents with lengths drawn log-uniformly
between 1K tokens and the sequence length, the last one cut to fit. A step's sequences are dealt to
the ranks as the training loop deals them: sorted by attention cost (the sum of squared document
lengths), so that the sequences ranks run side by side cost about the same (ProLong's minibatch
reordering; --no-reorder deals them as generated, and with --accum 1 gives each rank its own
draw, which leaves the faster rank waiting at every collective). The FoX variant's forget
gates are at their initialisation (biases spread over 1..6 per layer), so ACP prunes what those
gates allow, which is less than trained gates would.
Reported per setting: tokens/s/GPU, MFU of the executed FLOPs (over the datasheet peak and over the
measured bf16 matmul rate; ACP's skipped tiles not counted, their dense-equivalent rate apart), peak
memory per GPU and of the host process, the steps' losses, compile time and graphs, and for FoX with
ACP the pruned tile fraction; the timed steps' draws and their density (the documents' squared
lengths over seq^2: the Transformer's attention follows it, docs/benchmarks.md). Compare runs
at 1, 2, 4, 8 GPUs (the JSON holds the world size) for scaling efficiency. ProLong's anchor
(Table 15): 8B at 64K on 8 x H100 with FSDP, 2770 tokens/s/GPU (full attention) and 3095
(variable-length attention + minibatch reordering).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
from pathlib import Path

import torch

from longctx.model.attention import available, resolve
from longctx.model.recompute import MODES
from longctx.perf import measure, peak_memory, prepared, profile, write_result
from longctx.train.batches import Batch, attention_cost, packed_batch, schedule
from longctx.train.models import preset
from longctx.train.parallel import Parallel, close, init, with_sequence_parallel

PROLONG_8B_64K = {"full attention": 2770, "variable-length + reordering": 3095}


def documents(seq: int, seed: int, shortest: int = 1024) -> torch.Tensor:
    """cu_seqlens of one packed sequence: log-uniform document lengths in [shortest, seq]."""
    gen = torch.Generator().manual_seed(seed)
    bounds, at = [0], 0
    while at < seq:
        u = float(torch.rand((), generator=gen))
        at = min(seq, at + int(math.exp(math.log(min(shortest, seq)) + u * math.log(seq / min(shortest, seq)))))
        bounds.append(at)
    return torch.tensor(bounds, dtype=torch.int32)


def step_seeds(step: int, sequences: int) -> list[int]:
    """The seeds of one step's sequences (all data-parallel replicas'): its draw of documents."""
    return [1_000 * step + j for j in range(sequences)]


def density(seq: int, steps: list[int], sequences: int) -> float:
    """What the steps' attention costs against one document of seq tokens: the mean over their
    sequences of the documents' summed squared lengths over seq^2 (a step's cost follows it)."""
    seeds = [s for step in steps for s in step_seeds(step, sequences)]
    return sum(attention_cost(documents(seq, s)) for s in seeds) / len(seeds) / seq**2


def step_batches(seq: int, vocab: int, step: int, accum: int, par: Parallel, reorder: bool) -> list[Batch]:
    """This rank's micro-batches of one step, one sequence each: `accum` per data-parallel replica
    (the same on every rank of a sequence-parallel group), dealt as the training loop deals them
    (`schedule`: sorted by attention cost, so the ranks' side-by-side micro-batches cost about the
    same, ProLong's reordering) or, without `reorder`, in the order generated."""
    seeds = step_seeds(step, accum * par.dp)
    bounds = {s: documents(seq, s) for s in seeds}
    if reorder:
        costs = [attention_cost(bounds[s]) for s in seeds]
        mine = [m[0] for m in schedule(seeds, costs, 1, par.dp)[par.dp_rank]]
    else:
        mine = seeds[par.dp_rank * accum:(par.dp_rank + 1) * accum]
    return [packed_batch(torch.randint(0, vocab, (seq,), generator=torch.Generator().manual_seed(s)), bounds[s],
                         par.device, [s]) for s in mine]


def profiled(run, micro: list[Batch], par: Parallel) -> list[dict]:
    """One more step under torch.profiler on every rank: each rank's kernel ms by kind, and the
    time its GPU idled (on FSDP, mostly waiting for a slower rank's collective)."""
    mine = {k: v for k, v in profile(run, micro).items() if k in ("wall_ms", "kernel_ms", "by_kind_ms", "idle_ms")}
    if not par.distributed:
        return [mine]
    every: list = [None] * par.world
    torch.distributed.all_gather_object(every, mine)
    return every


def run_setting(name: str, args, base_par) -> dict:
    fox = name.startswith("fox")
    sp = base_par.world if name.endswith("sp") else 1
    seq = args.sp_seq if name.endswith("sp") else args.fsdp_seq
    cfg = preset(args.shape, "fox" if fox else "llama", seq)
    par = with_sequence_parallel(base_par, sp, cfg.n_heads)
    if fox:  # our kernel with ACP (Triton's interpreter in the CPU test)
        backend = "fox" if "fox" in available(par.device) else "auto"
    else:
        backend = args.attention
    row = {"setting": name, "model": "FoX (Pro)" if fox else "Transformer", "shape": args.shape, "seq": seq,
           "attention": resolve(backend, par.device, fox), "world": par.world, "sp": sp,
           "recompute": args.recompute, "offload": args.offload,
           "acp": backend == "fox", "docs": "generated, log-uniform 1K..seq", "accum": args.accum,
           "reorder": not args.no_reorder, "mlp_tile": args.mlp_tile, "offload_activations": args.offload_activations,
           "offload_keep_last": args.offload_keep_last}
    try:
        run = prepared(cfg, par, compile=not args.no_compile, recompute=args.recompute, acp=backend == "fox",
                       offload=args.offload, backend=backend, mlp_tile=args.mlp_tile,
                       offload_activations=args.offload_activations, offload_keep_last=args.offload_keep_last)
        row["compiled"] = run.cfg.compile and par.device.type == "cuda"
        batches = functools.partial(step_batches, seq, cfg.vocab_size, accum=args.accum, par=par,
                                    reorder=not args.no_reorder)
        if args.fit:  # two steps: AdamW makes its state in the first step's update, after that step's peak
            (seconds, loss), (second, loss2) = run.step(batches(0)), run.step(batches(1))
            row.update(fits=True, first_step_s=round(seconds, 2), second_step_s=round(second, 2), losses=[loss, loss2],
                       **peak_memory(par))
        else:
            timed = list(range(args.warmup + args.steps, args.warmup + 2 * args.steps))
            row.update(measure(run, batches, args.steps, args.warmup,
                               log=functools.partial(print, flush=True) if par.main else None),
                       timed_draws=timed, timed_density=round(density(seq, timed, args.accum * par.dp), 4))
        if args.profile and par.device.type == "cuda":
            row["profile_by_rank"] = profiled(run, batches(10_000), par)
    except torch.OutOfMemoryError as e:
        row["error"] = "out of memory"
        row["oom"] = str(e).split("\n")[0][:300]  # what it tried to allocate, and what was free
        if args.fit:
            row["fits"] = False
        if par.device.type == "cuda":
            row["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(par.device) / 2**30, 2)
    run = None
    if par.device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(par.device)
    return row


def scaling(results: list[dict]) -> list[dict]:
    """Scaling efficiency per setting: tokens/s/GPU at each world size over that at the smallest
    world size measured (runs of one setting must share shape and sequence length). Each world
    size deals its own documents, so the timed draws' attention density differs between them: the
    executed-MFU ratio (`mfu_efficiency`, GPUs only) is the efficiency with that taken out."""
    by_setting: dict[tuple, list[tuple[int, dict]]] = {}
    for res in results:
        for r in res["rows"]:
            if "tokens_per_s_per_gpu" in r:
                by_setting.setdefault((r["setting"], res["shape"], r["seq"]), []).append((res["world"], r))
    out = []
    for (setting, shape, seq), runs in sorted(by_setting.items()):
        runs.sort(key=lambda run: run[0])
        base_world, base = runs[0]
        for world, r in runs:
            mfu = round(r["mfu"] / base["mfu"], 3) if "mfu" in r and "mfu" in base else None
            out.append({"setting": setting, "shape": shape, "seq": seq, "world": world,
                        "tokens_per_s_per_gpu": r["tokens_per_s_per_gpu"],
                        "efficiency": round(r["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"], 3),
                        "mfu_efficiency": mfu, "timed_density": r.get("timed_density"), "base_world": base_world})
    return out


def long_vs_short(results: list[dict]) -> list[dict]:
    """Each sequence-parallel row against the fastest FSDP row of the same model, world size and
    recomputation. A token of a 512K sequence costs more attention FLOPs than one of a 64K
    sequence, so the MFU ratio is the attention-FLOP-adjusted throughput ratio (ProLong's stage 2
    against its stage 1; the goal is >= 0.8)."""
    rows = [{**r, "world": res["world"]} for res in results for r in res["rows"] if "tokens_per_s_per_gpu" in r]
    out = []
    for long in (r for r in rows if r["setting"].endswith("sp")):
        peers = [r for r in rows if r["setting"] == long["setting"][:-2] + "fsdp" and r["world"] == long["world"]
                 and r["recompute"] == long["recompute"]]
        if not peers:
            continue
        short = max(peers, key=lambda r: r["tokens_per_s_per_gpu"])
        out.append({"setting": long["setting"], "world": long["world"], "seq": long["seq"], "short_seq": short["seq"],
                    "recompute": long["recompute"], "tokens_per_s_per_gpu": long["tokens_per_s_per_gpu"],
                    "short_tokens_per_s_per_gpu": short["tokens_per_s_per_gpu"],
                    "ratio": round(long["tokens_per_s_per_gpu"] / short["tokens_per_s_per_gpu"], 3),
                    "flop_adjusted_ratio": round(long["mfu"] / short["mfu"], 3) if "mfu" in long and "mfu" in short
                    else None})  # (no MFU on a CPU: no peak to divide by)
    return out


def compare(paths: list[Path]) -> None:
    results = [json.loads(p.read_text()) for p in paths]
    print(f"{'setting':<9} {'seq':>7} {'GPUs':>5} {'tokens/s/GPU':>13} {'efficiency':>14} {'MFU ratio':>9} "
          f"{'density':>7}")
    for r in scaling(results):
        print(f"{r['setting']:<9} {r['seq']:>7} {r['world']:>5} {r['tokens_per_s_per_gpu']:>13} "
              f"{r['efficiency']:>8} vs {r['base_world']:<3} {r['mfu_efficiency'] or '-':>9} "
              f"{r['timed_density'] or '-':>7}")
    print(f"\n{'setting':<9} {'GPUs':>5} {'seq':>7} {'tokens/s/GPU':>13} {'vs seq':>7} {'tokens/s/GPU':>13} "
          f"{'ratio':>6} {'FLOP-adjusted':>14}")
    for r in long_vs_short(results):
        print(f"{r['setting']:<9} {r['world']:>5} {r['seq']:>7} {r['tokens_per_s_per_gpu']:>13} {r['short_seq']:>7} "
              f"{r['short_tokens_per_s_per_gpu']:>13} {r['ratio']:>6} {r['flop_adjusted_ratio'] or '-':>14}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--settings", nargs="+", default=["fsdp", "sp", "fox-fsdp", "fox-sp"],
                    choices=["fsdp", "sp", "fox-fsdp", "fox-sp"])
    ap.add_argument("--fsdp-seq", type=int, default=65536)
    ap.add_argument("--sp-seq", type=int, default=524288)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--recompute", default="full", choices=MODES, help="activation checkpointing per block")
    ap.add_argument("--accum", type=int, default=1, help="sequences per data-parallel rank per optimizer step")
    ap.add_argument("--no-reorder", action="store_true", help="deal a step's sequences to ranks in the order "
                    "generated, not sorted by attention cost as the training loop deals them")
    ap.add_argument("--fit", action="store_true", help="two steps only: does the setting fit in memory, and "
                    "its peak (for the longest sequence that fits)")
    ap.add_argument("--profile", action="store_true", help="one more step under torch.profiler per setting: "
                    "each rank's kernel time by kind and idle time")
    ap.add_argument("--offload", action="store_true", help="FSDP2 CPU offload of parameters, gradients, optimizer")
    ap.add_argument("--mlp-tile", type=int, help="tokens per MLP tile (the [tokens, ffn] intermediates one tile "
                    "at a time; default: untiled)")
    ap.add_argument("--offload-activations", action="store_true", help="full recomputation's block inputs in "
                    "pinned host memory (with --recompute full or halves)")
    ap.add_argument("--offload-keep-last", type=int, default=0, help="with --offload-activations: the last N "
                    "blocks keep their inputs on the GPU (host memory holds the others)")
    ap.add_argument("--no-compile", action="store_true", help="eager blocks (compiled is the default on CUDA)")
    ap.add_argument("--attention", default="auto", help="the Transformer's attention backend (auto: cuDNN on Hopper)")
    ap.add_argument("--tag", default="", help="appended to the result file's name")
    ap.add_argument("--out", type=Path, default=Path("bench/results/scale"),
                   help="folder of the JSON (<benchmark>-<device>-<date>.json)")
    ap.add_argument("--compare", type=Path, nargs="+", help="JSON results of runs at several GPU counts: "
                    "print the scaling efficiency, and sequence parallelism against FSDP, and exit")
    args = ap.parse_args()
    if args.compare:
        return compare(args.compare)
    par = init()
    rows = []
    gpu = par.device.type == "cuda"
    for name in args.settings:
        rows.append(run_setting(name, args, par))
        if not par.main:
            continue
        print(json.dumps(rows[-1]), flush=True)
        fields = {"world": par.world, "shape": args.shape, "rows": rows, "prolong_8b_64k": PROLONG_8B_64K}
        if gpu:  # after every setting: a run cut short keeps what it measured
            write_result(args.out, f"scale-{par.world}gpu{args.tag}", fields)
        else:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"scale-cpu-{par.world}{args.tag}.json").write_text(json.dumps(fields, indent=2) + "\n")
    if par.main:
        print(f"\n{args.shape}, {par.world} x {torch.cuda.get_device_name() if gpu else 'CPU'}")
        print(f"{'setting':<9} {'seq':>7} {'sp':>3} {'tokens/s/GPU':>13} {'MFU':>6} {'MFU/790':>7} {'peak GiB':>9} "
              f"{'host GiB':>8} {'pruned':>7} {'dense TF/s':>10} {'1st s':>6} {'density':>7}")
        for r in rows:
            speed = r.get("tokens_per_s_per_gpu", r.get("error", "fits" if r.get("fits") else "-"))
            print(f"{r['setting']:<9} {r['seq']:>7} {r['sp']:>3} {speed:>13} {r.get('mfu', '-'):>6} "
                  f"{r.get('mfu_matmul_ceiling', '-'):>7} {r.get('peak_memory_gib', '-'):>9} "
                  f"{r.get('peak_host_memory_gib', '-'):>8} "
                  f"{r.get('acp_pruned_fraction', '-'):>7} {r.get('dense_equivalent_tflops', '-'):>10} "
                  f"{r.get('first_step_s', '-'):>6} {r.get('timed_density', '-'):>7}")
        print(f"ProLong Table 15 (8B, 64K, 8 x H100, FSDP): {PROLONG_8B_64K} tokens/s/GPU")
    close()


if __name__ == "__main__":
    main()
