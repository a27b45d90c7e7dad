"""Kubernetes manifests for a training stage (issue 64): a Kubeflow PyTorchJob (kubeflow.org/v1) of
train.nodes pods, a Master and nodes - 1 Workers, each running the stage command in the project's
image (Dockerfile) with its GPUs and the workspace's volume claim at /workspace. The operator's
PET_NNODES, PET_MASTER_ADDR and PET_MASTER_PORT tell the stage where torchrun's c10d rendezvous is
(launch.nodes); a failed pod restarts, and the stage goes on from its last checkpoint. With
--claim-size, the ReadWriteMany claim too.

    python -m longctx.train.kubernetes pretrain --image registry.example.com/longctx:abc123 \\
        --claim longctx-workspace > pretrain.yaml && kubectl apply -f pretrain.yaml
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import yaml

from ..config import TrainParams, load
from ..errors import ConfigError, LongctxError
from . import launch

STAGES = ("base", "pretrain", "sft")
WORKSPACE = "/workspace"
PORT = 23456
"""The Master's rendezvous port (the operator's default, named pytorchjob-port)."""
NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def pytorchjob(stage: str, train: TrainParams, image: str, claim: str, *, name: str | None = None,
               namespace: str = "default", params: str = "params.yaml", gpus: int | None = None,
               restarts: int = 3) -> dict:
    """The PyTorchJob that runs `stage` on train.nodes pods of `gpus` GPUs (default train.nproc; 0: CPU
    pods of train.nproc processes)."""
    if stage not in STAGES:
        raise ConfigError(f"{stage!r}: not a training stage (one of {', '.join(STAGES)})")
    name = name or f"longctx-{stage}"
    if not NAME.match(name) or len(name) > 48:
        raise ConfigError(f"{name!r}: a job name is lower-case letters, digits and '-', at most 48 characters")
    n, per_node = launch.per_node(train, gpus, "--gpus")
    container = {
        "name": "pytorch",   # (the operator's name for the training container)
        "image": image,
        "command": ["python", "-m", f"stages.{stage}", "--params", params],
        "workingDir": WORKSPACE,
        "ports": [{"name": "pytorchjob-port", "containerPort": PORT}],
        "volumeMounts": [{"name": "workspace", "mountPath": WORKSPACE}, {"name": "shm", "mountPath": "/dev/shm"}],
        "env": [{"name": "PYTHONUNBUFFERED", "value": "1"}],
    }
    if n:
        container["resources"] = {"limits": {"nvidia.com/gpu": n}}
    pod = {"spec": {"containers": [container], "volumes": [
        {"name": "workspace", "persistentVolumeClaim": {"claimName": claim}},
        {"name": "shm", "emptyDir": {"medium": "Memory"}}]}}   # (NCCL and loader workers share memory)
    replicas = {"Master": {"replicas": 1, "restartPolicy": "OnFailure", "template": pod}}
    if train.nodes > 1:
        replicas["Worker"] = {"replicas": train.nodes - 1, "restartPolicy": "OnFailure", "template": pod}
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
            "metadata": {"name": name, "namespace": namespace, "labels": {"app.kubernetes.io/part-of": "longctx",
                                                                         "longctx/stage": stage}},
            "spec": {"nprocPerNode": str(per_node), "runPolicy": {"backoffLimit": restarts, "cleanPodPolicy": "None"},
                     "pytorchReplicaSpecs": replicas}}


def claim(name: str, size: str, namespace: str = "default", storage_class: str | None = None) -> dict:
    """The workspace's claim: ReadWriteMany, since every pod of a job (and the flow's) mounts it."""
    if not re.match(r"^\d+(\.\d+)?(Ki|Mi|Gi|Ti|Pi)$", size):
        raise ConfigError(f"--claim-size {size!r}: a size such as 500Gi")
    spec = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": size}}}
    if storage_class:
        spec["storageClassName"] = storage_class
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name, "namespace": namespace},
            "spec": spec}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m longctx.train.kubernetes", description=__doc__.split("\n\n")[0])
    ap.add_argument("stage", choices=STAGES)
    ap.add_argument("--params", default="params.yaml", help="the workspace's params (nodes and processes a node)")
    ap.add_argument("--image", required=True, help="the project's image (Dockerfile), pushed where the cluster pulls")
    ap.add_argument("--claim", default="longctx-workspace", help="the workspace's PersistentVolumeClaim")
    ap.add_argument("--claim-size", help="also write the claim, of this size (500Gi)")
    ap.add_argument("--storage-class", help="the claim's storage class (one that offers ReadWriteMany)")
    ap.add_argument("--namespace", default="default")
    ap.add_argument("--name", help="the job's name (default longctx-<stage>)")
    ap.add_argument("--gpus", type=int, help="GPUs a pod (default train.nproc; 0: CPU pods)")
    args = ap.parse_args(argv)
    try:
        train = load(args.params).train
        docs = [pytorchjob(args.stage, train, args.image, args.claim, name=args.name, namespace=args.namespace,
                           params=Path(args.params).name, gpus=args.gpus)]
        if args.claim_size:
            docs.insert(0, claim(args.claim, args.claim_size, args.namespace, args.storage_class))
    except LongctxError as e:
        print(f"kubernetes: error: {e}", file=sys.stderr)
        sys.exit(2)
    sys.stdout.write(yaml.safe_dump_all(docs, sort_keys=False))


if __name__ == "__main__":
    main()
