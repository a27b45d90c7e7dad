"""Scale-out training throughput (issue 9): full optimizer steps of a large shape over all ranks
with FSDP2, and with Ulysses sequence parallelism, as the training stages run them (bf16
autocast over fp32 weights, AdamW, activation checkpointing, chunked loss, document-masked
attention). Launch with torchrun, one process per GPU:

    torchrun --standalone --nproc-per-node 2 bench/scale.py --out bench/results

Settings (--settings):
  fsdp       Llama-3-8B shape, --fsdp-seq tokens (64K) per sequence, one sequence per rank per
             step, FSDP2 over all ranks (ProLong stage 1's layout)
  sp         --sp-seq tokens (512K) per sequence, Ulysses over all ranks (ProLong stage 2: SP 8)
  fox-fsdp   the FoX (Pro) variant of the same shape (no RoPE), the `fox` kernel with ACP
  fox-sp     the same with sequence parallelism
Data: generated packed sequences (random tokens): documents with lengths drawn log-uniformly
between 1K tokens and the sequence length, the last one cut to fit. The FoX variant's forget
gates are at their initialisation (biases spread over 1..6 per layer), so ACP prunes what those
gates allow, which is less than trained gates would.
Reported per setting: tokens/s/GPU, MFU, peak memory per GPU, the first steps' losses, and for
FoX with ACP the pruned tile fraction. Compare runs at 1, 2, 4, 8 GPUs (the JSON holds the world
size) for scaling efficiency. ProLong's anchor (Table 15): 8B at 64K on 8 x H100 with FSDP, 2770
tokens/s/GPU (full attention) and 3095 (variable-length attention + minibatch reordering).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from longctx.model.attention import Acp, available  # noqa: E402
from longctx.model.config import PRESETS, FoxConfig, ModelConfig, RopeConfig  # noqa: E402
from longctx.model.loss import IGNORE, shift_labels  # noqa: E402
from longctx.model.transformer import Transformer  # noqa: E402
from longctx.train.loop import Batch, _autocast, _peak_flops, flop_params, step_flops  # noqa: E402
from longctx.train.optim import adamw  # noqa: E402
from longctx.train.parallel import close, init, shard, with_sequence_parallel  # noqa: E402

SHAPES = {**PRESETS, "tiny": dict(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128)}
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


def batch(seq: int, vocab: int, step: int, replica: int, device: torch.device) -> Batch:
    """Replica `replica`'s sequence at `step`: the same on every rank of a sequence-parallel group
    and in a single-process run of replica 0."""
    seed = 1_000 * step + replica
    cu = documents(seq, seed)
    ids = torch.randint(0, vocab, (seq,), generator=torch.Generator().manual_seed(seed))
    return Batch(ids.to(device), cu.to(device), shift_labels(ids, cu.long()).to(device), [seed])


def build(shape: str, fox: bool, window: int, device: torch.device) -> Transformer:
    dims = dict(SHAPES[shape], max_position_embeddings=window)
    cfg = ModelConfig(**dims, rope=None, fox=FoxConfig()) if fox else ModelConfig(**dims, rope=RopeConfig(theta=5e5))
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it trains: an 8B model never sits in host memory
        return Transformer(cfg)


def run_setting(name: str, args, base_par) -> dict:
    fox = name.startswith("fox")
    sp = base_par.world if name.endswith("sp") else 1
    seq = args.sp_seq if name.endswith("sp") else args.fsdp_seq
    row = {"setting": name, "model": "FoX (Pro)" if fox else "Transformer", "shape": args.shape, "seq": seq,
           "world": base_par.world, "sp": sp, "docs": "generated, log-uniform 1K..seq"}
    model = build(args.shape, fox, seq, base_par.device)
    par = with_sequence_parallel(base_par, sp, model.cfg.n_heads)
    model.checkpoint_layers = True
    if fox and "fox" in available(par.device):  # CUDA (or Triton's interpreter in the CPU test)
        model.attention_backend = "fox"
        model.acp = Acp(args.acp_eps)
    row["acp"] = model.acp is not None
    shard(model, par)
    opt = adamw(model, 1e-5, (0.9, 0.95), 0.1)
    params = flop_params(model)
    times, losses, flops = [], [], 0.0
    try:
        for step in range(args.warmup + args.steps):
            b = batch(seq, model.cfg.vocab_size, step, par.dp_rank, par.device)
            valid = par.sum(int((b.labels != IGNORE).sum()) if par.sp_rank == 0 else 0)
            if par.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            with _autocast(par.device):
                loss = model(b.ids, b.cu_seqlens, sp_group=par.sp_group, labels=b.labels) / valid
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            total = par.sum(loss.item())
            if par.device.type == "cuda":
                torch.cuda.synchronize()
            losses.append(total)
            if step >= args.warmup:
                times.append(time.perf_counter() - t0)
                flops += step_flops(model.cfg, params, b) * par.dp  # every replica's sequence
    except torch.OutOfMemoryError:
        row["error"] = "out of memory"
    if times:
        sec = sum(times) / len(times)
        row.update(step_s=round(sec, 3), tokens_per_s_per_gpu=round(seq * par.dp / sec / par.world, 1),
                   losses=losses)
        peak = _peak_flops(par.device)
        if peak:
            row["mfu"] = round(flops / len(times) / sec / peak / par.world, 4)
    if par.device.type == "cuda":
        row["peak_memory_gib"] = round(par.sum(torch.cuda.max_memory_allocated(par.device)) / par.world / 2**30, 2)
    if model.acp is not None:
        row["acp_pruned_fraction"] = round(par.sum(model.acp.stats.pruned_fraction() or 0.0) / par.world, 4)
    del model, opt
    if par.device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(par.device)
    return row


def scaling(results: list[dict]) -> list[dict]:
    """Scaling efficiency per setting: tokens/s/GPU at each world size over that at the smallest
    world size measured (runs of one setting must share shape and sequence length)."""
    by_setting: dict[tuple, list[tuple[int, float]]] = {}
    for res in results:
        for r in res["rows"]:
            if "tokens_per_s_per_gpu" in r:
                key = (r["setting"], res["shape"], r["seq"])
                by_setting.setdefault(key, []).append((res["world"], r["tokens_per_s_per_gpu"]))
    out = []
    for (setting, shape, seq), runs in sorted(by_setting.items()):
        base_world, base = min(runs)
        for world, speed in sorted(runs):
            out.append({"setting": setting, "shape": shape, "seq": seq, "world": world,
                        "tokens_per_s_per_gpu": speed, "efficiency": round(speed / base, 3), "base_world": base_world})
    return out


def compare(paths: list[Path]) -> None:
    rows = scaling([json.loads(p.read_text()) for p in paths])
    print(f"{'setting':<9} {'seq':>7} {'GPUs':>5} {'tokens/s/GPU':>13} {'efficiency':>11}")
    for r in rows:
        print(f"{r['setting']:<9} {r['seq']:>7} {r['world']:>5} {r['tokens_per_s_per_gpu']:>13} "
              f"{r['efficiency']:>8} vs {r['base_world']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--settings", nargs="+", default=["fsdp", "sp", "fox-fsdp", "fox-sp"],
                    choices=["fsdp", "sp", "fox-fsdp", "fox-sp"])
    ap.add_argument("--fsdp-seq", type=int, default=65536)
    ap.add_argument("--sp-seq", type=int, default=524288)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--acp-eps", type=float, default=math.exp(-10))
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--compare", type=Path, nargs="+", help="JSON results of runs at several GPU counts: "
                    "print the scaling efficiency and exit")
    args = ap.parse_args()
    if args.compare:
        return compare(args.compare)
    par = init()
    rows = []
    for name in args.settings:
        rows.append(run_setting(name, args, par))
        if par.main:
            print(json.dumps(rows[-1]), flush=True)
    if par.main:
        print(f"\n{args.shape}, {par.world} x {torch.cuda.get_device_name() if par.device.type == 'cuda' else 'CPU'}")
        print(f"{'setting':<9} {'seq':>7} {'sp':>3} {'tokens/s/GPU':>13} {'MFU':>6} {'peak GiB':>9} {'pruned':>7}")
        for r in rows:
            speed = r.get("tokens_per_s_per_gpu", r.get("error", "-"))
            print(f"{r['setting']:<9} {r['seq']:>7} {r['sp']:>3} {speed:>13} "
                  f"{r.get('mfu', '-'):>6} {r.get('peak_memory_gib', '-'):>9} {r.get('acp_pruned_fraction', '-'):>7}")
        print(f"ProLong Table 15 (8B, 64K, 8 x H100, FSDP): {PROLONG_8B_64K} tokens/s/GPU")
        fields = {"world": par.world, "shape": args.shape, "rows": rows, "prolong_8b_64k": PROLONG_8B_64K}
        if par.device.type == "cuda":
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from _results import write_result

            write_result(args.out, f"scale-{par.world}gpu", fields)
        else:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"scale-cpu-{par.world}.json").write_text(json.dumps(fields, indent=2) + "\n")
    close()


if __name__ == "__main__":
    main()
