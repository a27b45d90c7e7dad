"""bench/scale.py on two CPU ranks (gloo) at a tiny shape: every setting runs and reports, and
the sequence-parallel run's losses equal a single process's on the same sequences."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO

ARGS = ["bench/scale.py", "--shape", "tiny", "--fsdp-seq", "512", "--sp-seq", "2048", "--steps", "1", "--accum", "2",
        "--warmup", "1"]


def run(cmd: list[str], out) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd + ["--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "tokens/s/GPU" in done.stdout  # the table
    if "--fit" not in cmd:  # the isolated steps as they end (the warm-up and 1 of --steps 1)
        assert "step 2 of 3" in done.stdout and "step 3 of " not in done.stdout
    (path,) = out.glob("scale-cpu-*.json")
    return json.loads(path.read_text())


@pytest.mark.slow
def test_two_ranks_report_every_setting_and_match_one_process(tmp_path):
    two = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *ARGS,
               "--settings", "fsdp", "sp", "fox-fsdp", "--recompute", "halves"], tmp_path / "two")
    # (same losses: full recomputation and MLP tiles in one process, halves over two ranks)
    one = run([sys.executable, *ARGS, "--settings", "sp", "--mlp-tile", "300"], tmp_path / "one")
    rows = {r["setting"]: r for r in two["rows"]}
    assert two["world"] == 2 and set(rows) == {"fsdp", "sp", "fox-fsdp"}
    assert rows["sp"]["sp"] == 2 and rows["fsdp"]["sp"] == 1
    for r in rows.values():
        assert r["tokens_per_s_per_gpu"] > 0 and len(r["losses"]) == 1 + 2 * 1  # warm-up, isolated, queued
        assert r["timed_draws"] == [2]  # (the queued step's documents: its draw, whose density the row gives)
        assert r["attention"] == ("fox" if r["model"] == "FoX (Pro)" else "sdpa")
    sys.path.insert(0, str(REPO / "bench"))
    from scale import density, documents

    # the timed step's documents against one of 2,048 tokens: fsdp's 2 ranks x 2 sequences (one document each), sp's 2
    assert rows["sp"]["timed_density"] == pytest.approx(density(2048, [2], 2), abs=1e-4)
    assert rows["fsdp"]["timed_density"] == pytest.approx(density(512, [2], 4), abs=1e-4)
    lengths = [(b[1:] - b[:-1]).double() for b in (documents(2048, 2000), documents(2048, 2001))]
    assert density(2048, [2], 2) == pytest.approx(sum(float((x**2).sum()) for x in lengths) / 2 / 2048**2)
    assert 0.0 <= rows["fox-fsdp"]["acp_pruned_fraction"] < 1.0
    assert rows["sp"]["losses"] == pytest.approx(one["rows"][0]["losses"], rel=1e-5)
    assert one["rows"][0]["mlp_tile"] == 300 and rows["sp"]["mlp_tile"] is None
    assert all("peak_host_memory_gib" in r for r in [*rows.values(), *one["rows"]])  # (the process's lifetime peak)

    # scaling efficiency across the two runs: sp at 1 and 2 processes, the smaller as the base
    from scale import scaling

    eff = {r["world"]: r for r in scaling([one, two]) if r["setting"] == "sp"}
    assert eff[1]["efficiency"] == 1.0
    ratio = rows["sp"]["tokens_per_s_per_gpu"] / one["rows"][0]["tokens_per_s_per_gpu"]
    assert eff[2]["efficiency"] == pytest.approx(ratio, abs=5e-4)  # rounded to 3 decimals
    assert eff[2]["timed_density"] == rows["sp"]["timed_density"] and eff[2]["mfu_efficiency"] is None  # (no GPU)
    shown = subprocess.run([sys.executable, "bench/scale.py", "--compare", *map(str, tmp_path.glob("*/scale-*.json"))],
                           cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert "efficiency" in shown and "fox-fsdp" in shown
    assert re.search(r"\nsp +2 +2048 .* 512 ", shown)  # sp against fsdp of the same run


def test_sequence_parallelism_is_compared_with_fsdp_of_the_same_model_ranks_and_recomputation():
    sys.path.insert(0, str(REPO / "bench"))
    from scale import long_vs_short

    def row(setting, seq, recompute, speed, mfu):
        return {"setting": setting, "seq": seq, "recompute": recompute, "tokens_per_s_per_gpu": speed, "mfu": mfu}

    eight = {"world": 8, "rows": [
        row("fsdp", 65536, "full", 6000.0, 0.40), row("fsdp", 65536, "full", 5000.0, 0.33),
        row("fsdp", 65536, "attention", 7000.0, 0.45), row("sp", 524288, "full", 3000.0, 0.36),
        row("fox-sp", 524288, "full", 4000.0, 0.30), {"setting": "sp", "error": "oom"}]}
    two = {"world": 2, "rows": [row("fsdp", 65536, "full", 9999.0, 0.9), row("fox-fsdp", 65536, "full", 1.0, 0.1)]}
    (only,) = long_vs_short([eight, two])  # fox-sp has no FoX FSDP row on 8 ranks; the 2-rank rows are not its peers
    assert only["setting"] == "sp" and only["world"] == 8 and only["short_tokens_per_s_per_gpu"] == 6000.0
    assert only["ratio"] == 0.5 and only["flop_adjusted_ratio"] == 0.9


def test_a_steps_sequences_are_dealt_by_attention_cost():
    sys.path.insert(0, str(REPO / "bench"))
    from scale import step_batches

    from longctx.train.parallel import Parallel

    def cost(b):
        return int(((b.cu_seqlens[1:] - b.cu_seqlens[:-1]).long() ** 2).sum())  # written out: not the bench's

    for reorder in (True, False):
        ranks = [step_batches(65536, 100, 2, 3, Parallel(rank=r, world=2), reorder) for r in range(2)]
        seeds = sorted(b.samples[0] for rank in ranks for b in rank)
        assert seeds == list(range(2000, 2006))  # every sequence of the step once, 3 per rank
        if reorder:  # side by side, the cheaper ones first: each pair neighbours in cost order
            costs = sorted(cost(b) for rank in ranks for b in rank)
            for k in range(3):
                assert sorted((cost(ranks[0][k]), cost(ranks[1][k]))) == costs[2 * k:2 * k + 2]
        else:
            assert [b.samples[0] for b in ranks[1]] == [2003, 2004, 2005]
    # one sequence per rank, as generated: replica r's draw is seed 1000 * step + r
    assert step_batches(4096, 100, 5, 1, Parallel(rank=1, world=2), False)[0].samples == [5001]


def test_fit_takes_two_steps_and_says_it_fits(tmp_path):
    data = run([sys.executable, *ARGS, "--settings", "fsdp", "--fit"], tmp_path)
    (row,) = data["rows"]
    assert row["fits"] is True and len(row["losses"]) == 2 and "tokens_per_s_per_gpu" not in row
    assert 5.9 < row["losses"][0] < 6.6  # ln(vocab 512) = 6.24 at initialisation: a real step ran


def test_scaling_sets_the_mfu_ratio_beside_the_throughput_ratio():
    """Each world size times its own draws: 4 GPUs' denser documents cost more attention per token,
    which the executed-MFU ratio takes out (an H200 pair: 0.768 by tokens/s, 0.826 by MFU)."""
    sys.path.insert(0, str(REPO / "bench"))
    from scale import scaling

    def run(world, speed, mfu, dens):
        return {"world": world, "shape": "llama3-8b", "rows": [{"setting": "fsdp", "seq": 65536, "mfu": mfu,
                                                              "tokens_per_s_per_gpu": speed, "timed_density": dens}]}

    rows = scaling([run(4, 4373.4, 0.2863, 0.3826), run(2, 5694.5, 0.3466, 0.2943)])
    assert [(r["world"], r["efficiency"], r["mfu_efficiency"], r["timed_density"]) for r in rows] == \
        [(2, 1.0, 1.0, 0.2943), (4, 0.768, 0.826, 0.3826)]
