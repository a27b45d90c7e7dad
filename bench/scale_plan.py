"""On paper, toward 64 nodes (issue 64 item 5): the step time, tokens/s/GPU, memory per GPU and the
bounding resource of the 8B shape at 64K and 512K on 1-64 nodes of 8 GPUs, with flat FSDP (every
rank one shard group) and HSDP (shards within a node, replicas across), predicted from one measured
single-host row and stated link speeds.

    python bench/scale_plan.py                                   # the table, and JSON under bench/results/scale-plan
    python bench/scale_plan.py --ib-gbps 200 --gpu-memory-gib 141 --nodes 1 4 16

The model, and what it assumes:
- Compute: a rank's micro-batch costs its model FLOPs (6 per parameter per token plus causal attention
  over each document, the MFU count of longctx.train.loop) at one effective rate, fitted on the
  calibration row (bench/scale.py's steady 2-GPU 64K row: FSDP, full recomputation, 2 sequences a rank).
  Each micro-batch waits for the slowest rank (FSDP's collectives join them every layer), so a step is
  the sum over micro-batches of the most expensive rank's, over the same generated documents (log-uniform
  1K..seq) dealt as the training loop deals them (sorted by attention cost). The check row (the 4-GPU
  run) is predicted, not fitted: the table says how far off.
- FSDP2's collectives per micro-batch: all-gather of bf16 weights in the forward and again in the
  backward, reduce-scatter of fp32 gradients; a ring over the shard group, each rank sending
  (g-1)/g of the bytes at its link's rate, plus a per-hop latency for each of the 3 collectives of each
  block. They overlap compute (prefetch): a micro-batch takes the longer of the two. A group within a
  node runs on NVLink; a group across nodes on each GPU's InfiniBand rail. HSDP adds, once a step,
  an all-reduce of each rank's gradient shard across the nodes (a ring over the nodes, IB), counted
  as not overlapped (FSDP2 overlaps it with the rest of the backward: an upper bound).
- Ulysses (512K: sequence parallelism over a node's 8 GPUs; at 64K where ranks outnumber the batch's
  sequences): 4 all-to-alls a block in each of the forward, the recomputation and the backward, on
  NVLink, not overlapped.
- Memory per GPU: 16 bytes a parameter (fp32 master, AdamW's two moments, fp32 gradient), over the
  shard group, plus the calibration row's working memory (activations at its tokens per rank), scaled
  by tokens per rank. Both fitted from the 2- and 4-GPU rows' peaks.
- Batch: ProLong's 4M tokens (64K) and 8M (512K) a step. Where data-parallel replicas outnumber the
  sequences, sequence parallelism grows (within a node) to make up; where it cannot, the batch grows to
  one sequence a replica and the row says so.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale import documents, step_seeds  # noqa: E402  (the generated documents the measured rows trained on)

from longctx.model.transformer import Transformer  # noqa: E402
from longctx.perf import write_result  # noqa: E402
from longctx.train.batches import attention_cost, schedule  # noqa: E402
from longctx.train.models import preset  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
CALIBRATION = RESULTS / "scale" / "scale-2gpu-64k-full-steady-2gpu-nvidia-h200-2026-11-28.json"
CHECK = RESULTS / "scale" / "scale-4gpu-64k-full-steady-4gpu-nvidia-h200-2026-11-28.json"
STATE_BYTES = 16
"""A parameter's bytes in the shards: fp32 master, AdamW's two fp32 moments, the fp32 gradient."""
BLOCK_COLLECTIVES = 3
"""FSDP2's collectives a block and micro-batch: all-gather (forward), all-gather (backward), reduce-scatter."""


@dataclass(frozen=True)
class Links:
    nvlink_gbs: float = 900.0
    """NVLink per GPU, both directions together (H100/H200 SXM: 900 GB/s); a ring sends at half."""
    ib_gbps: float = 400.0
    """InfiniBand per GPU (one 400 Gb/s rail a GPU), one direction."""
    nvlink_latency_us: float = 3.0
    ib_latency_us: float = 10.0

    def rate(self, across: bool) -> tuple[float, float]:
        """(bytes/s one way, seconds a ring hop) of a group within a node or across nodes."""
        return (self.ib_gbps / 8 * 1e9, self.ib_latency_us * 1e-6) if across else \
            (self.nvlink_gbs / 2 * 1e9, self.nvlink_latency_us * 1e-6)


@dataclass(frozen=True)
class Shape:
    params: int
    """All parameters (the shards hold them all)."""
    flop_params: int
    """Those that cost 6 FLOPs a token (the embedding lookup is free)."""
    layers: int
    heads: int
    attn_dim: int
    kv_dim: int

    @classmethod
    def of(cls, name: str, seq: int) -> Shape:
        cfg = preset(name, "llama", seq)
        with torch.device("meta"):
            model = Transformer(cfg)
        named = list(model.named_parameters())
        return cls(sum(p.numel() for _, p in named), sum(p.numel() for n, p in named if "embed_tokens" not in n),
                   cfg.n_layers, cfg.n_heads, cfg.n_heads * cfg.dim_head, cfg.n_kv_heads * cfg.dim_head)

    def flops(self, seq: int, attention: int) -> float:
        """Model FLOPs of one sequence's forward and backward (longctx.train.flops.step_flops)."""
        return 6 * self.flop_params * seq + 6 * self.layers * self.attn_dim * attention


def compute_seconds(shape: Shape, seq: int, dp: int, sequences: int, sp: int, rate: float,
                    draws: list[int]) -> float:
    """A step's compute: per micro-batch its most expensive rank's FLOPs at `rate`, over `draws`
    (generated steps), averaged."""
    total = 0.0
    for step in draws:
        seeds = step_seeds(step, sequences)
        costs = [attention_cost(documents(seq, s)) for s in seeds]
        cost = dict(zip(seeds, costs, strict=True))
        per_rank = schedule(seeds, costs, 1, dp)
        for j in range(sequences // dp):
            total += max(shape.flops(seq, cost[per_rank[r][j][0]]) for r in range(dp)) / sp / rate
    return total / len(draws)


def ring(nbytes: float, group: int, across: bool, links: Links, collectives: int) -> float:
    """Seconds of `collectives` ring collectives moving `nbytes` in all over `group` ranks."""
    if group == 1:
        return 0.0
    bandwidth, hop = links.rate(across)
    return nbytes * (group - 1) / group / bandwidth + collectives * (group - 1) * hop


@dataclass(frozen=True)
class Fit:
    rate: float
    """Effective model-FLOP rate of one GPU (FLOP/s)."""
    working_gib: float
    """Working memory of a rank at `working_tokens` tokens (activations, gathered blocks)."""
    working_tokens: int
    check: dict


def fit(shape: Shape, calibration: dict, check: dict) -> Fit:
    """The rate from the calibration row; the working memory from the two rows' peaks (their
    difference is the shards'); the check row predicted with them."""
    rows = []
    for res in (calibration, check):
        (r,) = [r for r in res["rows"] if r["setting"] == "fsdp"]
        if r["recompute"] != "full" or r["sp"] != 1:
            raise SystemExit(f"{res['benchmark']}: the planner calibrates on FSDP rows with full recomputation")
        rows.append(r)
    cal, chk = rows
    flops_s = compute_seconds(shape, cal["seq"], cal["world"], cal["accum"] * cal["world"], 1, 1.0,
                              cal["timed_draws"])
    rate = flops_s / cal["step_s"]
    shards_gib = STATE_BYTES * shape.params / 2**30
    fitted_state = (cal["peak_memory_gib"] - chk["peak_memory_gib"]) / (1 / cal["world"] - 1 / chk["world"])
    working = cal["peak_memory_gib"] - shards_gib / cal["world"]
    predicted = compute_seconds(shape, chk["seq"], chk["world"], chk["accum"] * chk["world"], 1, rate,
                                chk["timed_draws"])
    return Fit(rate, working, cal["seq"], {
        "row": check["benchmark"], "measured_step_s": chk["step_s"], "predicted_step_s": round(predicted, 2),
        "error": round(predicted / chk["step_s"] - 1, 3),
        "measured_tokens_per_s_per_gpu": chk["tokens_per_s_per_gpu"],
        "predicted_tokens_per_s_per_gpu": round(chk["seq"] * chk["accum"] / predicted, 1),
        "measured_peak_gib": chk["peak_memory_gib"],
        "predicted_peak_gib": round(shards_gib / chk["world"] + working, 2),
        "state_bytes_per_param_from_peaks": round(fitted_state * 2**30 / shape.params, 2)})


@dataclass(frozen=True)
class Row:
    nodes: int
    gpus: int
    layout: str
    seq: int
    sp: int
    dp: int
    sequences: int
    batch_grown: bool
    compute_s: float
    fsdp_comm_s: float
    ulysses_s: float
    cross_node_s: float
    step_s: float
    tokens_per_s_per_gpu: float
    memory_gib: float
    fits: bool
    comm_over_compute: float
    """FSDP's collectives (and the cross-node all-reduce) over the compute they hide behind: the
    headroom before the network bounds the step."""
    bound: str


def plan_row(shape: Shape, fitted: Fit, links: Links, nodes: int, per_node: int, layout: str, seq: int,
             batch_tokens: int, min_sp: int, memory_gib: float, draws: list[int]) -> Row:
    gpus = nodes * per_node
    sequences = max(1, batch_tokens // seq)
    sp = min_sp
    while gpus // sp > sequences and sp * 2 <= per_node and shape.heads % (sp * 2) == 0:
        sp *= 2   # more replicas than sequences: split each sequence over more of a node's GPUs
    dp = gpus // sp
    grown = dp > sequences or sequences % dp != 0
    if grown:
        sequences = -(-sequences // dp) * dp
    accum = sequences // dp
    compute = compute_seconds(shape, seq, dp, sequences, sp, fitted.rate, draws)
    group, across = (gpus, nodes > 1) if layout == "fsdp" else (per_node, False)
    weights = 2 * shape.params
    per_micro = ring(2 * weights + 2 * weights, group, across, links, BLOCK_COLLECTIVES * shape.layers)
    # (bf16 weights gathered twice, fp32 gradients reduce-scattered: 2 + 2 + 4 bytes a parameter)
    local = seq // sp
    a2a_bytes = local * (2 * shape.attn_dim + 2 * shape.kv_dim) * 2 * 3 * shape.layers
    ulysses = ring(a2a_bytes, sp, False, links, 4 * 3 * shape.layers) if sp > 1 else 0.0
    cross = 0.0
    if layout == "hsdp" and nodes > 1:   # each rank's fp32 gradient shard all-reduced over the nodes
        cross = 2 * ring(4 * shape.params / per_node, nodes, True, links, shape.layers)
    per_micro_compute = compute / accum + ulysses
    step = accum * max(per_micro_compute, per_micro) + cross
    bound = "compute" if per_micro_compute >= per_micro else ("InfiniBand" if across else "NVLink")
    if cross > 0.2 * step:
        bound += " + cross-node all-reduce"
    memory = STATE_BYTES * shape.params / group / 2**30 + fitted.working_gib * local / fitted.working_tokens
    return Row(nodes, gpus, layout, seq, sp, dp, sequences, grown, round(compute, 2), round(per_micro * accum, 2),
               round(ulysses * accum, 2), round(cross, 2), round(step, 2), round(sequences * seq / step / gpus, 1),
               round(memory, 1), memory <= memory_gib,
               round((per_micro * accum + cross) / (per_micro_compute * accum), 3), bound)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 8, 32, 64])
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--nvlink-gbs", type=float, default=Links.nvlink_gbs, help="NVLink per GPU, GB/s (both ways)")
    ap.add_argument("--ib-gbps", type=float, default=Links.ib_gbps, help="InfiniBand per GPU, Gb/s")
    ap.add_argument("--nvlink-latency-us", type=float, default=Links.nvlink_latency_us)
    ap.add_argument("--ib-latency-us", type=float, default=Links.ib_latency_us)
    ap.add_argument("--gpu-memory-gib", type=float, default=80.0, help="per GPU (H100: 80; H200: 141)")
    ap.add_argument("--calibration", type=Path, default=CALIBRATION)
    ap.add_argument("--check", type=Path, default=CHECK)
    ap.add_argument("--draws", type=int, default=3, help="generated steps each prediction averages")
    ap.add_argument("--out", type=Path, default=RESULTS / "scale-plan")
    args = ap.parse_args(argv)
    links = Links(args.nvlink_gbs, args.ib_gbps, args.nvlink_latency_us, args.ib_latency_us)
    calibration, check = (json.loads(p.read_text()) for p in (args.calibration, args.check))
    shape = Shape.of(args.shape, 65536)
    fitted = fit(shape, calibration, check)
    draws = list(range(3, 3 + args.draws))
    rows = [plan_row(shape, fitted, links, n, args.gpus_per_node, layout, seq, batch, min_sp, args.gpu_memory_gib,
                     draws)
            for seq, batch, min_sp in ((65536, 4 << 20, 1), (524288, 8 << 20, args.gpus_per_node))
            for layout in ("fsdp", "hsdp") for n in args.nodes]
    c = fitted.check
    print(f"{args.shape}: {fitted.rate / 1e12:.0f} TFLOP/s a GPU (model FLOPs) fitted on {calibration['benchmark']}; "
          f"{c['row']}: step {c['predicted_step_s']} s predicted, {c['measured_step_s']} measured "
          f"({c['error']:+.1%}); peak {c['predicted_peak_gib']} GiB predicted, {c['measured_peak_gib']} measured")
    print(f"links: NVLink {links.nvlink_gbs:g} GB/s, IB {links.ib_gbps:g} Gb/s a GPU; "
          f"{args.gpu_memory_gib:g} GiB a GPU")
    print(f"state from the two rows' peaks: {c['state_bytes_per_param_from_peaks']} bytes a parameter "
          f"(assumed {STATE_BYTES})")
    print(f"{'seq':>7} {'layout':<6} {'nodes':>5} {'GPUs':>5} {'sp':>3} {'seqs':>5} {'step s':>8} "
          f"{'tok/s/GPU':>9} {'GiB/GPU':>8} {'comm s':>7} {'comm/compute':>12} {'bound':<10}")
    for r in rows:
        grown = "*" if r.batch_grown else " "
        print(f"{r.seq:>7} {r.layout:<6} {r.nodes:>5} {r.gpus:>5} {r.sp:>3} {r.sequences:>4}{grown} "
              f"{r.step_s:>8} {r.tokens_per_s_per_gpu:>9} {r.memory_gib:>7}{'' if r.fits else '!'} "
              f"{r.fsdp_comm_s + r.cross_node_s:>7} {r.comm_over_compute:>12} {r.bound:<10}")
    print("* batch grown to one sequence a replica; ! over the GPU's memory")
    fields = {"shape": args.shape, "links": asdict(links), "gpu_memory_gib": args.gpu_memory_gib,
              "calibration": calibration["benchmark"], "rate_tflops": round(fitted.rate / 1e12, 1),
              "working_gib": round(fitted.working_gib, 2), "check": c, "rows": [asdict(r) for r in rows]}
    write_result(args.out, "scale-plan", fields, device=calibration["device"])
    return fields


if __name__ == "__main__":
    main()
