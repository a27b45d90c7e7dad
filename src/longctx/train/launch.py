"""How a training stage starts its processes: torchrun on this machine alone, or on every node of
an allocation through torchrun's own c10d rendezvous (issue 64). Each node runs the same stage
command (Slurm's `srun`, a Kubernetes PyTorchJob's pods, or a user on each machine); torchrun
assigns the ranks, and global rank 0 writes the outputs. No launcher of our own."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from ..config import TrainParams
from ..errors import ConfigError

PORT = 29400
"""The rendezvous port on the head node when the launcher names none (torchrun's default)."""


@dataclass(frozen=True)
class Nodes:
    count: int
    endpoint: str | None = None
    """host:port of the c10d rendezvous (None on one node)."""
    job: str = "longctx"
    """The rendezvous id: every node of one run gives the same one."""
    source: str = "params"


def nodes(train: TrainParams, env: Mapping[str, str] = os.environ) -> Nodes:
    """The nodes this run spans: a Slurm allocation (SLURM_NNODES, its first node the head), a
    Kubeflow PyTorchJob (PET_NNODES, PET_MASTER_ADDR/PORT), else train.nodes with
    train.rdzv_endpoint. The launcher's count wins over params, which only serve without one."""
    if int(env.get("SLURM_NNODES", "1")) > 1:
        head = env.get("MASTER_ADDR") or _slurm_head(env)
        return Nodes(int(env["SLURM_NNODES"]), train.rdzv_endpoint or f"{head}:{env.get('MASTER_PORT', PORT)}",
                     f"slurm-{env.get('SLURM_JOB_ID', '0')}", "Slurm")
    pet = int(env.get("PET_NNODES", "1").split(":")[-1])  # (elastic jobs say min:max)
    if pet > 1:
        if not env.get("PET_MASTER_ADDR"):
            raise ConfigError("PET_NNODES is set but PET_MASTER_ADDR is not: the PyTorchJob names no head node")
        return Nodes(pet, f"{env['PET_MASTER_ADDR']}:{env.get('PET_MASTER_PORT', PORT)}",
                     env.get("PET_RDZV_ID", "pytorchjob"), "PyTorchJob")
    if train.nodes == 1:
        return Nodes(1)
    if not train.rdzv_endpoint:
        raise ConfigError(f"train.nodes: {train.nodes} nodes need train.rdzv_endpoint, the host:port of one of them "
                          "every node reaches (or run under Slurm or a PyTorchJob, which say it)")
    return Nodes(train.nodes, train.rdzv_endpoint, env.get("LONGCTX_RDZV_ID", "longctx"))


def _slurm_head(env: Mapping[str, str]) -> str:
    """The address Slurm reaches the allocation's first node at (SLURM_JOB_NODELIST is compressed:
    node[01-04]; a node's NodeAddr is its hostname unless slurm.conf says another)."""
    listed = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not listed:
        raise ConfigError("SLURM_NNODES > 1 but SLURM_JOB_NODELIST is unset: set MASTER_ADDR to the head node")
    if shutil.which("scontrol") is None:
        raise ConfigError(f"SLURM_JOB_NODELIST={listed}: scontrol is not on PATH to expand it; set MASTER_ADDR to "
                          "the head node")
    out = subprocess.run(["scontrol", "show", "hostnames", listed], capture_output=True, text=True, timeout=30)
    if out.returncode or not out.stdout.split():
        raise ConfigError(f"scontrol show hostnames {listed}: {out.stderr.strip() or 'no hosts'}")
    head = out.stdout.split()[0]
    node = subprocess.run(["scontrol", "show", "node", "-o", head], capture_output=True, text=True, timeout=30)
    addr = [f.split("=", 1)[1] for f in node.stdout.split() if f.startswith("NodeAddr=")]
    return addr[0] if addr and addr[0] != "(null)" else head


def per_node(train: TrainParams, gpus: int | None, field: str) -> tuple[int, int]:
    """(GPUs, training processes) a node of a cluster job asks for: `gpus` (the job's own setting,
    named `field` in errors), else train.nproc; 0 GPUs: a CPU job of train.nproc processes. A job
    must say its count where train.nproc is "auto" (the submitting machine's GPUs say nothing)."""
    if gpus is None:
        if train.nproc == "auto":
            raise ConfigError(f"train.nproc is auto, so a node's GPUs are unknown to the job: set {field} "
                              "(0 for a CPU job)")
        gpus = int(train.nproc)
    return gpus, gpus or (1 if train.nproc == "auto" else int(train.nproc))


def torchrun(stage: str, params: str, nproc: int, on: Nodes) -> list[str]:
    """The command that runs `stage` as `nproc` processes on each node of `on`."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    if on.count == 1:
        cmd.insert(3, "--standalone")
    else:
        cmd[3:3] = [f"--nnodes={on.count}", "--rdzv-backend=c10d", f"--rdzv-endpoint={on.endpoint}",
                    f"--rdzv-id={on.job}-{stage}"]
    return [*cmd, "-m", f"stages.{stage}", "--params", params]
