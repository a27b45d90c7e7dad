"""`prefect deployment run longctx-pipeline/tiny` against a real Prefect server on 127.0.0.1 with
a process work pool and a worker, on the smallest profile, in a finished run's copy whose SFT param
changed: the flow run completes, every stage's `dvc repro` ran (SFT and eval, which reads it, rerun),
and the MLflow store holds its parent run with those two as children."""

from __future__ import annotations

import subprocess

import pytest
import yaml
from mlflow.tracking import MlflowClient

from conftest import SMALL, copy_workspace, sh
from longctx.config import merge

pytestmark = pytest.mark.slow  # end to end through real DVC, Prefect and MLflow: `pytest -m "not slow"` skips it


def test_deployment_run_on_a_worker(small_run, tmp_path, prefect_server):
    ws = tmp_path / "ws"
    env = {**copy_workspace(small_run[0], ws, store=False), "LONGCTX_WORKSPACE": str(ws), **prefect_server}
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
