"""`prefect deployment run longctx-pipeline/tiny` against a real Prefect server on 127.0.0.1 with
a process work pool and a worker, on the smallest profile, in a finished run's copy whose SFT param
changed: the flow run completes, every stage's `dvc repro` ran (SFT and eval, which reads it, rerun),
and the MLflow store holds its parent run with those two as children."""

from __future__ import annotations

import os
import socket
import subprocess
import time
import urllib.request

import pytest
import yaml
from mlflow.tracking import MlflowClient

from conftest import SMALL, copy_workspace, sh
from longctx.config import merge

pytestmark = pytest.mark.slow  # end to end through real DVC, Prefect and MLflow: `pytest -m "not slow"` skips it


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server(tmp_path):
    port = free_port()
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_API_URL": f"http://127.0.0.1:{port}/api"}
    env.pop("PREFECT_API_KEY", None)
    proc = subprocess.Popen(["prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=2)
            break
        except OSError:
            time.sleep(1)
    else:
        proc.kill()
        pytest.fail("the Prefect server did not start in 120 s")
    yield env
    proc.terminate()
    proc.wait(timeout=30)


def test_deployment_run_on_a_worker(small_run, tmp_path, server):
    ws = tmp_path / "ws"
    env = {**copy_workspace(small_run[0], ws, store=False), "LONGCTX_WORKSPACE": str(ws),
           **{k: v for k, v in server.items() if k.startswith("PREFECT")}}
    (ws / "params.yaml").write_text(yaml.safe_dump(merge(SMALL, {"train": {"sft": {"lr": 2e-3}}}), sort_keys=False))
    sh(["prefect", "work-pool", "create", "longctx-local", "--type", "process"], ws, env)
    sh(["prefect", "--no-prompt", "deploy", "--name", "tiny"], ws, env)
    worker = subprocess.Popen(["prefect", "worker", "start", "--pool", "longctx-local"], cwd=ws, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        out = subprocess.run(["prefect", "deployment", "run", "longctx-pipeline/tiny", "--watch"], cwd=ws, env=env,
                             capture_output=True, text=True, timeout=1500)
    finally:
        worker.terminate()
        try:
            worker.wait(timeout=10)
        except subprocess.TimeoutExpired:  # a worker's graceful shutdown is not what this tests
            worker.kill()
            worker.wait()
    assert out.returncode == 0 and "Completed" in out.stdout + out.stderr, out.stdout[-3000:] + out.stderr[-3000:]
    client = MlflowClient(f"sqlite:///{ws / 'mlflow.db'}")
    exp = client.get_experiment_by_name("longctx")
    parents = client.search_runs([exp.experiment_id], filter_string="tags.`longctx.stage` = 'pipeline'")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    kids = client.search_runs([exp.experiment_id],
                              filter_string=f"tags.mlflow.parentRunId = '{parents[0].info.run_id}'")
    assert {r.info.run_name: r.info.status for r in kids} == {"sft": "FINISHED", "eval": "FINISHED"}
    assert "up to date" in sh(["dvc", "status"], ws, env)  # the outputs are the new params' (dvc.lock)
