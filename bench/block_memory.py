"""What a block's recomputation and backward hold on the GPU at their peak, by the code that
allocated it (issue 34: at 524,288 local tokens of the 8B shape one block's backward needed ~70
GiB beside the kept inputs; the cuts to that working set are chosen from this). One training step
of the 8B shape cut to a few layers, prepared as the training stages prepare it (full
recomputation, MLP tiles, compiled blocks or eager), under the CUDA caching allocator's history:
the allocations live at the step's peak, grouped by their innermost longctx frame. Memory of
flash-style attention and tiled MLPs grows linearly in the tokens, so a step at 64K tokens says
what one at 512K needs (x8).
    python bench/block_memory.py [--tokens 65536] [--models llama fox] [--out DIR]"""

from __future__ import annotations

import argparse
import itertools
import time
from collections import Counter
from pathlib import Path

import torch

from longctx.perf import one_document, prepared, write_result
from longctx.train.models import preset
from longctx.train.parallel import Parallel

GIB = 2**30


def site(frames: list[dict], size: int, unit: int) -> str:
    """Where an allocation came from: the innermost frame in longctx's code, after the innermost
    frame of all when that is a compiled graph's or torch's own ("graph <- transformer.py:.."); with
    no Python frame (autograd's engine, or a trace without stacks), its size in block inputs."""
    if not frames:
        return f"(no Python frame) {size / unit:.3g} block inputs"
    ours = next((f for f in frames if "/longctx/" in f["filename"]), None)
    first = frames[0]
    where = (f"{Path(ours['filename']).name}:{ours['line']} {ours['name']}" if ours is not None else
             f"{Path(first['filename']).name}:{first['line']} {first['name']}")
    if "torchinductor" in first["filename"]:
        return "compiled graph <- " + where
    return where


def live_at_peak(events: list[dict], unit: int = 1) -> tuple[int, list[tuple[int, str]]]:
    """(the largest sum of live bytes over the trace, the allocations live then as (bytes, site)).
    Counts what the trace allocated and freed; what was allocated before it (weights, optimizer
    state) is the base it adds to. `unit`: a block input's bytes."""
    live: dict[int, tuple[int, list]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, list]] = {}
    for e in events:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], e.get("frames", []))
            total += e["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif e["action"] == "free_completed" and e["addr"] in live:
            total -= live.pop(e["addr"])[0]
    return peak, [(size, site(frames, size, unit)) for size, frames in at_peak.values()]


def by_site(allocs: list[tuple[int, str]], listed: int = 14) -> list[dict]:
    sums, counts = Counter(), Counter()
    for size, where in allocs:
        sums[where] += size
        counts[where] += 1
    return [{"site": where, "gib": round(b / GIB, 3), "tensors": counts[where]}
            for where, b in sums.most_common(listed)]


def measure(arch: str, compile: bool, tokens: int, layers: int, tile: int, recompute: str, stacks: bool) -> dict:
    """One step's peak over the step before it; with `stacks`, each allocation's Python frames
    (torch 2.11 failed a compiled block's recomputation under them: SystemError in autograd)."""
    dev = torch.device("cuda")
    cfg = preset("llama3-8b", arch, tokens).model_copy(update={"n_layers": layers})
    run = prepared(cfg, Parallel(device=dev), compile=compile, recompute=recompute, acp=arch == "fox",
                   backend="fox" if arch == "fox" else "auto", mlp_tile=tile)
    batch = [one_document(tokens, cfg.vocab_size, dev)]
    run.step(batch)  # compiles; AdamW makes its state
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python",
                                             context="alloc" if stacks else None)
    seconds, _ = run.step(batch)
    trace = torch.cuda.memory._snapshot()["device_traces"][dev.index or 0]
    torch.cuda.memory._record_memory_history(enabled=None)
    unit = tokens * cfg.d_model * 2
    peak, allocs = live_at_peak(trace, unit)
    row = {"model": arch, "compiled": compile, "recompute": recompute, "tokens": tokens, "layers": layers,
           "mlp_tile": tile, "step_s": round(seconds, 3), "base_gib": round(base / GIB, 2),
           "peak_over_base_gib": round(peak / GIB, 2),
           "allocator_peak_over_base_gib": round((torch.cuda.max_memory_allocated(dev) - base) / GIB, 2),
           "input_gib": round(unit / GIB, 3), "sites": by_site(allocs)}
    row["inputs_at_peak"] = round(peak / unit, 1)
    del run
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tile", type=int, default=8192, help="MLP tile: 8 tiles, as 65,536 at 512K")
    ap.add_argument("--models", nargs="+", default=["llama", "fox"])
    ap.add_argument("--recompute", nargs="+", default=["full"])
    ap.add_argument("--eager", action="store_true", help="eager blocks too")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    rows = []
    for arch, recompute, compile in itertools.product(args.models, args.recompute,
                                                      (True, False) if args.eager else (True,)):
        t0 = time.perf_counter()
        row = measure(arch, compile, args.tokens, args.layers, args.tile, recompute, stacks=not compile)
        rows.append(row)
        print(f"\n{arch} {recompute} {'compiled' if compile else 'eager'}: peak {row['peak_over_base_gib']} GiB over "
              f"the base {row['base_gib']} ({row['inputs_at_peak']} block inputs of {row['input_gib']} GiB; allocator "
              f"{row['allocator_peak_over_base_gib']}), step {row['step_s']} s [{time.perf_counter() - t0:.0f} s]",
              flush=True)
        for s in row["sites"]:
            print(f"  {s['gib']:>8.3f} GiB {s['tensors']:>4}  {s['site']}")
    write_result(args.out, "block_memory", {"tokens": args.tokens, "rows": rows})


if __name__ == "__main__":
    main()
