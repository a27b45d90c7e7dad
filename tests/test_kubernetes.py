"""The cluster's manifests (issue 64 item 4), checked without a cluster: the PyTorchJob a training
stage renders, its claim, and the Prefect Kubernetes work pool's job template, each against the
resource's published schema (tests/data/kubernetes); the Dockerfile the image is built from, by lint
rules and by what it copies and installs."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
import tomllib

import jsonschema
import pytest
import yaml

from conftest import REPO
from longctx import config
from longctx.errors import ConfigError
from longctx.train import kubernetes, launch

SCHEMAS = REPO / "tests" / "data" / "kubernetes"


def schema(name: str) -> dict:
    return json.loads((SCHEMAS / f"{name}.schema.json").read_text())


def test_the_pytorchjob_of_a_stage_is_valid_and_says_nodes_gpus_and_the_workspace(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"profile": "tiny", "train": {"nodes": 4, "nproc": 8}}))
    done = subprocess.run([sys.executable, "-m", "longctx.train.kubernetes", "pretrain", "--params", str(params),
                           "--image", "registry.example.com/longctx:abc123", "--claim", "ws", "--claim-size", "500Gi",
                           "--namespace", "ml"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    pvc, job = yaml.safe_load_all(done.stdout)
    jsonschema.validate(pvc, schema("persistentvolumeclaim-v1"))
    jsonschema.validate(job, schema("pytorchjob-v1"))
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"] and pvc["metadata"]["name"] == "ws"
    assert (job["apiVersion"], job["kind"], job["metadata"]["namespace"]) == ("kubeflow.org/v1", "PyTorchJob", "ml")
    replicas = job["spec"]["pytorchReplicaSpecs"]
    # the operator's own rules (its webhook): Master and Worker only, one Master, a container named pytorch
    assert set(replicas) == {"Master", "Worker"} and replicas["Master"]["replicas"] == 1
    assert replicas["Worker"]["replicas"] == 3 and job["spec"]["nprocPerNode"] == "8"
    for spec in replicas.values():
        pod = spec["template"]["spec"]
        [c] = pod["containers"]
        assert c["name"] == "pytorch" and c["resources"]["limits"]["nvidia.com/gpu"] == 8
        assert c["command"] == ["python", "-m", "stages.pretrain", "--params", "params.yaml"]
        assert c["workingDir"] == "/workspace" and {"name": "workspace", "mountPath": "/workspace"} in c["volumeMounts"]
        assert {"name": "workspace", "persistentVolumeClaim": {"claimName": "ws"}} in pod["volumes"]
    # the schema is live: what the API server would refuse, it refuses
    for break_it in (lambda j: j["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
                     ["resources"]["limits"].update({"nvidia.com/gpu": "eight"}),
                     lambda j: j["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
                     ["volumeMounts"][0].pop("mountPath"),
                     lambda j: j["spec"].update({"nprocsPerNode": "8"})):
        broken = copy.deepcopy(job)
        break_it(broken)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, schema("pytorchjob-v1"))
    # what the operator gives a Worker pod (PET_*, and RANK, which is not torchrun's: the stage still launches it)
    pet = {"PET_NNODES": "4", "PET_MASTER_ADDR": "longctx-pretrain-master-0", "PET_MASTER_PORT": str(kubernetes.PORT),
           "RANK": "2", "WORLD_SIZE": "32"}
    on = launch.nodes(config.resolve({"profile": "tiny"}).train, pet)
    assert on.count == 4 and on.endpoint == f"longctx-pretrain-master-0:{kubernetes.PORT}"


def test_one_node_is_a_master_alone_and_cpu_pods_ask_for_no_gpu():
    train = config.resolve({"profile": "tiny", "train": {"nproc": 2}}).train
    job = kubernetes.pytorchjob("base", train, "img:1", "ws", gpus=0)
    jsonschema.validate(job, schema("pytorchjob-v1"))
    assert set(job["spec"]["pytorchReplicaSpecs"]) == {"Master"} and job["spec"]["nprocPerNode"] == "2"
    assert "resources" not in job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    with pytest.raises(ConfigError, match="not a training stage"):
        kubernetes.pytorchjob("eval", train, "img:1", "ws")
    with pytest.raises(ConfigError, match="set --gpus"):
        kubernetes.pytorchjob("sft", train.model_copy(update={"nproc": "auto"}), "img:1", "ws")
    with pytest.raises(ConfigError, match="job name"):
        kubernetes.pytorchjob("sft", train, "img:1", "ws", name="Bad_Name")


def test_the_work_pools_job_template_renders_a_valid_job_on_the_workspace_claim():
    from prefect.server.schemas.actions import validate_base_job_template
    from prefect.utilities.templating import apply_values

    template = json.loads((REPO / "deploy" / "kubernetes" / "work-pool.json").read_text())
    validate_base_job_template(template)   # Prefect's own check: every placeholder is a declared variable
    variables = template["variables"]["properties"]
    deployment = next(d for d in yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]
                      if d["name"] == "cluster")
    assert deployment["work_pool"]["name"] == "longctx-k8s" and set(deployment["work_pool"]["job_variables"]) <= set(
        variables)
    values = {k: v["default"] for k, v in variables.items() if "default" in v}
    values.update(image="registry.example.com/longctx:abc123", namespace="ml", workspace_claim="ws",
                  name="flow-run", command="prefect flow-run execute", labels={"app": "longctx"}, annotations={})
    job = apply_values(template["job_configuration"], values, remove_notset=True)["job_manifest"]

    def drop_none(x):
        if isinstance(x, dict):
            return {k: drop_none(v) for k, v in x.items() if v is not None and v != ""}
        return [drop_none(v) for v in x] if isinstance(x, list) else x
    job = drop_none(job)
    pod = job["spec"]["template"]["spec"]
    # (the worker requires these two in the pod spec, where the Job schema has no place for them)
    assert pod.pop("parallelism") == 1 and pod.pop("completions") == 1
    [c] = pod["containers"]
    c["env"] = [{"name": k, "value": v} for k, v in c["env"].items()]   # the worker's own conversion
    c["args"] = c["args"].split()
    jsonschema.validate(job, schema("job-batch-v1"))
    assert pod["volumes"] == [{"name": "workspace", "persistentVolumeClaim": {"claimName": "ws"}}]
    assert c["volumeMounts"] == [{"name": "workspace", "mountPath": "/workspace"}] and c["workingDir"] == "/workspace"
    assert {"name": "DVC_NO_ANALYTICS", "value": "1"} in c["env"]


def instructions(text: str) -> list[tuple[str, str]]:
    """A Dockerfile's (INSTRUCTION, arguments), continuation lines joined, comments dropped."""
    out, pending = [], ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip("\\").strip() + " "
        if not line.endswith("\\"):
            word, _, rest = pending.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            pending = ""
    return out


def test_the_dockerfile_builds_the_project_on_a_pinned_cuda_pytorch_base():
    steps = instructions((REPO / "Dockerfile").read_text())
    args = {k: v for kind, a in steps if kind == "ARG" for k, _, v in [a.partition("=")]}
    [base] = [a for kind, a in steps if kind == "FROM"]
    base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)
    m = re.fullmatch(r"pytorch/pytorch:(\d+\.\d+\.\d+)-cuda(\d+\.\d+)-cudnn\d+-(devel|runtime)", base)
    assert m, base   # pinned, never latest
    torch_req = next(d for d in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
                     if d.startswith("torch"))
    low, high = re.findall(r"\d+\.\d+(?:\.\d+)?", torch_req)
    version = tuple(map(int, m.group(1).split(".")))
    assert tuple(map(int, low.split("."))) <= version <= tuple(map(int, high.split(".")))
    for kind, a in steps:
        if kind == "COPY":   # everything it copies is the project's own, and there
            for src in a.split()[:-1]:
                assert (REPO / src).exists(), src
        if kind == "RUN" and "apt-get install" in a:
            assert "--no-install-recommends" in a and "rm -rf /var/lib/apt/lists" in a
    copied = {src.split("/")[0] for kind, a in steps if kind == "COPY" for src in a.split()[:-1]}
    assert {"pyproject.toml", "src", "stages", "pipelines", "dvc.yaml", "params.yaml"} <= copied
    runs = " ".join(a for kind, a in steps if kind == "RUN")
    assert 'pip install --no-build-isolation ".[gpu]"' in runs and "-e ." in runs
    assert ("ENV", "PYTHONPATH=/opt/longctx") in steps and any(kind == "CMD" for kind, _ in steps)
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {"data", "models", "runs", ".venv", ".git", "mlflow.db"} <= set(ignored)   # code, not a run's data
