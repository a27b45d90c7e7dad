"""Where a training stage's processes run (train/launch.py): the nodes a launcher or the params
name, and the torchrun command for them (the run itself: test_distributed.py's two nodes)."""

from __future__ import annotations

import sys

import pytest

from longctx import config
from longctx.errors import ConfigError
from longctx.train import launch

TRAIN = config.resolve({"profile": "tiny"}).train


def test_one_node_is_torchruns_standalone_rendezvous():
    assert launch.nodes(TRAIN, {}) == launch.Nodes(1)
    assert launch.torchrun("base", "p.yaml", 2, launch.Nodes(1)) == [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "stages.base",
        "--params", "p.yaml"]


def test_the_launchers_nodes_win_over_the_params():
    two = TRAIN.model_copy(update={"nodes": 2, "rdzv_endpoint": "10.0.0.1:29500"})
    on = launch.nodes(two, {"SLURM_NNODES": "4", "SLURM_JOB_ID": "812", "MASTER_ADDR": "gpu-07"})
    assert on == launch.Nodes(4, "10.0.0.1:29500", "slurm-812", "Slurm")  # (the params' endpoint kept)
    on = launch.nodes(TRAIN, {"SLURM_NNODES": "4", "SLURM_JOB_ID": "812", "MASTER_ADDR": "gpu-07"})
    assert on.endpoint == f"gpu-07:{launch.PORT}"
    assert launch.torchrun("sft", "params.yaml", 8, on)[3:8] == [
        "--nnodes=4", "--rdzv-backend=c10d", f"--rdzv-endpoint=gpu-07:{launch.PORT}", "--rdzv-id=slurm-812-sft",
        "--nproc-per-node=8"]
    pet = {"PET_NNODES": "1:3", "PET_MASTER_ADDR": "job-master-0", "PET_MASTER_PORT": "23456"}
    assert launch.nodes(TRAIN, pet) == launch.Nodes(3, "job-master-0:23456", "pytorchjob", "PyTorchJob")
    assert launch.nodes(two, {"SLURM_NNODES": "1"}) == launch.Nodes(2, "10.0.0.1:29500", "longctx")


def test_nodes_without_a_meeting_place_are_refused_by_name(monkeypatch):
    with pytest.raises(ConfigError, match=r"train.nodes: 2 nodes need train.rdzv_endpoint"):
        launch.nodes(TRAIN.model_copy(update={"nodes": 2}), {})
    with pytest.raises(ConfigError, match="PET_MASTER_ADDR is not"):
        launch.nodes(TRAIN, {"PET_NNODES": "2"})
    monkeypatch.setenv("PATH", "")
    with pytest.raises(ConfigError, match=r"SLURM_JOB_NODELIST=gpu\[01-04\]: scontrol is not on PATH"):
        launch.nodes(TRAIN, {"SLURM_NNODES": "4", "SLURM_JOB_NODELIST": "gpu[01-04]"})
    with pytest.raises(ConfigError, match="train.rdzv_endpoint"):
        config.resolve({"profile": "tiny", "train": {"rdzv_endpoint": "no-port"}})
