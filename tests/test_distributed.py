"""Distributed training on CPU with gloo and 2 real processes (torchrun): FSDP2 data parallelism
and Ulysses sequence parallelism give the single-process losses, gradients and weights."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, stage_process
from longctx.data.loader import PackedDataset
from longctx.model.loss import IGNORE
from longctx.train.batches import attention_cost, make_batch, schedule

RUNS = {"llama": ["single", "dp2", "sp2"], "fox": ["single", "sp2"]}


def launch(data: Path, out: Path, arch: str, mode: str) -> Path:
    path = os.pathsep.join(filter(None, [str(REPO / "src"), str(REPO / "tests"), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    worker = str(REPO / "tests" / "dist_worker.py")
    sp = "2" if mode == "sp2" else "1"
    if mode == "single":
        cmd = [sys.executable, worker]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", worker]
    folder = out / f"{arch}-{mode}"
    proc = subprocess.run([*cmd, str(data), str(folder), arch, sp], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return folder


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> dict[tuple[str, str], Path]:
    # LONGCTX_PACKED: a packed split made elsewhere (GPU machines without the data stages' deps)
    data = Path(os.environ.get("LONGCTX_PACKED") or
                request.getfixturevalue("small_project") / "data/packed/stage1/train")
    out = tmp_path_factory.mktemp("dist")
    return {(arch, mode): launch(data, out, arch, mode) for arch, modes in RUNS.items() for mode in modes}


def losses(folder: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (folder / "run" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(("arch", "mode"), [(a, m) for a, ms in RUNS.items() for m in ms if m != "single"])
def test_two_ranks_match_one_process(runs, arch, mode):
    one, two = runs[(arch, "single")], runs[(arch, mode)]
    assert json.loads((two / "loss.json").read_text()) == pytest.approx(json.loads((one / "loss.json").read_text()),
                                                                         rel=1e-6)
    g1, g2 = load_file(str(one / "grads.safetensors")), load_file(str(two / "grads.safetensors"))
    assert g1.keys() == g2.keys()
    for name in g1:
        assert g1[name].abs().max() > 0, f"{name}: no gradient"
        torch.testing.assert_close(g2[name], g1[name], rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    # training runs in bf16 autocast on GPUs, where sequence parallelism changes the kernels' shapes
    bf16 = torch.cuda.is_available()
    assert losses(two) == pytest.approx(losses(one), rel=1e-3 if bf16 else 1e-6) and len(losses(one)) == 3
    # FSDP2's sharded optimizer took the same steps: the final (gathered) weights agree
    w1 = load_file(str(one / "run/checkpoints/step-00000003/model.safetensors"))
    w2 = load_file(str(two / "run/checkpoints/step-00000003/model.safetensors"))
    for name in w1:
        # Adam normalizes tiny gradient differences up to a fraction of the step size (lr 3e-3); with
        # bf16 noise a near-zero gradient can flip sign: at most 2 lr per step
        torch.testing.assert_close(w2[name], w1[name], rtol=1e-4, atol=2 * 3e-3 * 3 if bf16 else 3e-5)


def test_schedule_deals_sorted_costs_to_ranks():
    samples = [10, 11, 12, 13, 14, 15, 16, 17]
    costs = [5, 90, 1, 70, 30, 8, 60, 2]
    per_rank = schedule(samples, costs, micro_batch=1, dp=2)
    # sorted by cost: 12(1) 17(2) 10(5) 15(8) 14(30) 16(60) 13(70) 11(90); ranks take pairs side by side
    assert per_rank == [[[12], [10], [14], [13]], [[17], [15], [16], [11]]]
    cost = dict(zip(samples, costs, strict=True))
    # micro-batches run at the same time differ less than in the unsorted order
    sorted_gap = sum(abs(cost[a[0]] - cost[b[0]]) for a, b in zip(*per_rank, strict=True))
    plain_gap = sum(abs(costs[i] - costs[i + 1]) for i in range(0, 8, 2))
    assert sorted_gap < plain_gap
    assert sorted(s for r in per_rank for mb in r for s in mb) == samples


def test_batch_is_padded_for_sequence_parallelism(small_project):
    data = PackedDataset(small_project / "data/packed/stage1/train")
    b = make_batch(data, [0], torch.device("cpu"), multiple=3)
    n = len(data[0].input_ids)
    assert b.ids.numel() % 3 == 0 and b.ids.numel() - n == -n % 3
    assert int(b.cu_seqlens[-1]) == b.ids.numel()
    assert (b.labels[n:] == IGNORE).all()
    lengths = (data[0].cu_seqlens[1:] - data[0].cu_seqlens[:-1]).astype("int64")
    assert attention_cost(data[0].cu_seqlens) == int((lengths**2).sum())


def test_base_stage_launches_itself_on_two_processes(project_copy):
    from conftest import SMALL

    params = {**SMALL, "tracking": {"uri": f"sqlite:///{project_copy / 'mlflow.db'}"}}
    base = {**SMALL["train"]["base"], "micro_batch": 1, "grad_accum": 3}
    two = {**params, "train": {**SMALL["train"], "base": base, "nproc": 2}}
    refused = stage_process(project_copy, "base", two)
    assert refused.returncode != 0
    assert ("train.base.grad_accum: 3 micro-batches per step do not divide over 2 data-parallel replicas"
            in refused.stderr)
    assert "processes" not in refused.stderr  # refused before starting any
    assert not (project_copy / "models/base").exists()

    base["grad_accum"] = 2
    done = stage_process(project_copy, "base", two)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 processes" in done.stderr
    two_ranks = json.loads((project_copy / "metrics/base.json").read_text())
    shutil.rmtree(project_copy / "models/base")
    shutil.rmtree(project_copy / "runs")
    one = stage_process(project_copy, "base", {**two, "train": {**two["train"], "nproc": 1}})
    assert one.returncode == 0, one.stderr[-3000:]
    one_rank = json.loads((project_copy / "metrics/base.json").read_text())
    assert two_ranks["train_loss"] == pytest.approx(one_rank["train_loss"], rel=1e-5)
    assert two_ranks["val_loss"] == pytest.approx(one_rank["val_loss"], rel=1e-5)
    assert (project_copy / "models/base/longctx_config.json").is_file()


def test_two_nodes_of_two_processes_train_as_one_node_of_four(project_copy, tmp_path):
    """Issue 64: two "nodes" on this machine, each the same stage command with 2 processes, meet
    through torchrun's c10d rendezvous on 127.0.0.1: the losses of one node of 4 processes. Their
    HSDP checkpoint (sharded over a node's 2 ranks, replicated on the 2 nodes) resumes on one node
    of 4 and on one process with the losses the two nodes had."""
    from conftest import SMALL, stage_env, write_params

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {**SMALL["train"]["base"], "micro_batch": 1, "grad_accum": 4}
    train = {**SMALL["train"], "base": base, "nproc": 2, "nodes": 2, "rdzv_endpoint": f"127.0.0.1:{port}"}
    write_params(project_copy, {**SMALL, "tracking": {"enabled": False}, "train": train})
    nodes = [subprocess.Popen([sys.executable, "-m", "stages.base"], cwd=project_copy, env=stage_env(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    said = [node.communicate(timeout=600)[1] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], said[0][-2000:] + said[1][-2000:]
    assert all(f"base: 2 processes on each of 2 nodes (params, rendezvous 127.0.0.1:{port})" in s for s in said)
    assert "base: weights sharded over the 2 ranks of each node, replicated on 2 nodes" in "".join(said)

    def losses(folder: Path) -> list[float]:
        return [json.loads(line)["loss"] for line in next(folder.glob("runs/base/*/metrics.jsonl"))
                .read_text().splitlines()]

    def on_one_node(folder: Path, nproc: int, says: str) -> list[float]:
        one = stage_process(folder, "base", {**SMALL, "tracking": {"enabled": False},
                                             "train": {**train, "nproc": nproc, "nodes": 1, "rdzv_endpoint": None}})
        assert one.returncode == 0 and says in one.stderr, one.stderr[-2000:]
        return losses(folder)

    two_nodes = losses(project_copy)
    assert len(two_nodes) == base["steps"]
    resumed = {}
    for nproc, says in [(4, "base: weights sharded over 4 ranks"), (1, "base: goes on from step 2 (")]:
        folder = tmp_path / f"resume-{nproc}"
        shutil.copytree(project_copy, folder)
        shutil.rmtree(folder / "models/base")
        [last] = folder.glob(f"runs/base/*/checkpoints/step-{base['steps']:08d}")
        shutil.rmtree(last)  # the run resumes from step 2's checkpoint, written by the two nodes
        resumed[nproc] = on_one_node(folder, nproc, says)
    assert resumed[4] == pytest.approx(two_nodes, rel=1e-6) and resumed[1] == pytest.approx(two_nodes, rel=1e-5)
    shutil.rmtree(project_copy / "models/base")
    shutil.rmtree(project_copy / "runs")
    assert on_one_node(project_copy, 4, "base: 4 processes: ") == pytest.approx(two_nodes, rel=1e-6)


def test_a_node_that_dies_stops_the_other_and_the_stage_resumes_from_its_checkpoint(project_copy):
    """Issue 64: two "nodes" of 2 processes; after the first checkpoint every process of node B (its
    stage command, torchrun's agent, its workers) is killed. Node A stops within seconds with one
    line naming the checkpoint a rerun goes on from; nothing is written but complete checkpoints;
    the rerun, on one node, goes on from there."""
    from conftest import SMALL, stage_env, write_params

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {**SMALL["train"]["base"], "micro_batch": 1, "grad_accum": 4, "steps": 40, "checkpoint_every": 10}
    train = {**SMALL["train"], "base": base, "nproc": 2, "nodes": 2, "rdzv_endpoint": f"127.0.0.1:{port}"}
    write_params(project_copy, {**SMALL, "tracking": {"enabled": False}, "train": train})
    nodes = [subprocess.Popen([sys.executable, "-m", "stages.base"], cwd=project_copy, env=stage_env(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    deadline = time.monotonic() + 300
    while not list(project_copy.glob("runs/base/*/checkpoints/step-00000010/trainer_state.json")):
        assert time.monotonic() < deadline and nodes[0].poll() is None, "no checkpoint came"
        time.sleep(0.05)
    dead = [nodes[1].pid]   # torchrun starts its workers in sessions of their own: the node's whole tree
    for pid in dead:
        dead += map(int, subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split())
    for pid in dead:
        os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    said = nodes[0].communicate(timeout=120)[1]
    nodes[1].communicate()
    assert nodes[0].returncode != 0 and time.monotonic() - killed < 60, said[-3000:]
    [last] = [line for line in said.splitlines() if line.startswith("base: stopped on this node")]
    assert said.rstrip().endswith(last)
    [ckpt] = [c for c in project_copy.glob("runs/base/*/checkpoints/*") if c.name in last]   # complete, named
    assert (ckpt / "trainer_state.json").is_file() and not (project_copy / "models" / "base").exists()
    assert not (project_copy / "metrics" / "base.json").exists()
    assert all((c / "trainer_state.json").is_file() for c in project_copy.glob("runs/base/*/checkpoints/step-*"))
    step = int(ckpt.name.split("-")[1])
    again = stage_process(project_copy, "base", {**SMALL, "tracking": {"enabled": False},
                                                 "train": {**train, "nodes": 1, "rdzv_endpoint": None}})
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"base: goes on from step {step} (" in again.stderr
    assert (project_copy / "models" / "base" / "model.safetensors").is_file()


def test_sequence_parallel_groups_stay_on_a_node():
    """Ulysses' all-to-alls on NVLink, never across the network: on 2 nodes of 4 ranks a group of 4
    fits a node, a group of 8 (dividing the world and the heads) is refused, naming the field."""
    from longctx.config.train_params import StageParams
    from longctx.errors import ConfigError
    from longctx.train.parallel import check_layout

    def stage(sp: int, accum: int = 1) -> StageParams:
        return StageParams(split="base", steps=1, lr=1e-3, sequence_parallel=sp, grad_accum=accum)

    check_layout(stage(4, 2), 8, "train.base.", n_heads=8, nodes=2)
    check_layout(stage(8), 8, "train.base.", n_heads=8)  # one node of 8
    with pytest.raises(ConfigError, match=r"train\.base\.sequence_parallel: 8 does not divide the 4 ranks of a node"):
        check_layout(stage(8), 8, "train.base.", n_heads=8, nodes=2)
    with pytest.raises(ValueError, match="sharding"):
        StageParams(split="base", steps=1, lr=1e-3, sharding="replicated")

