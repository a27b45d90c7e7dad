"""The Prefect pipeline flow on the smallest profile (prefect_test_harness, real DVC, real MLflow):
a failing stage fails the flow with its own error, the rerun after the fix skips what DVC already
made, MLflow holds one parent run per flow run with the stages that ran as children, and a second
run on a busy workspace is refused. (The main command's run of every stage under this flow:
tests/test_dvc_pipeline.py.)"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient
from prefect.testing.utilities import prefect_test_harness

from conftest import SMALL, copy_workspace, dvc_workspace, sh
from longctx.config import merge
from longctx.errors import WorkspaceBusy
from longctx.eval import compare
from longctx.io import pipeline_lock
from pipelines.flows import GPU_LIMIT, STAGES, StageFailed, ensure_gpu_limit, pipeline, sweep

pytestmark = pytest.mark.slow  # end to end through real DVC, Prefect and MLflow: `pytest -m "not slow"` skips it


@pytest.fixture(scope="module")
def harness():
    with prefect_test_harness(server_startup_timeout=120):
        yield


def children(client: MlflowClient, parent) -> dict[str, str]:
    query = f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    runs = client.search_runs([parent.info.experiment_id], filter_string=query)
    return {r.info.run_name: r.info.status for r in runs}


def test_failure_then_resume_and_mlflow_parent_runs(small_run, tmp_path, monkeypatch, harness, capsys):
    """From a finished run (its own MLflow store) whose SFT param changed: SFT runs, then eval
    fails on impossible lengths; the fix reruns eval alone."""
    ws = tmp_path / "ws"
    env = copy_workspace(small_run[0], ws, store=False)
    fixed = merge(SMALL, {"train": {"sft": {"lr": 2e-3}}})
    (ws / "params.yaml").write_text(yaml.safe_dump(merge(fixed, {"eval": {"lengths": [100_000]}}), sort_keys=False))
    monkeypatch.setenv("PYTHONPATH", env["PYTHONPATH"])

    # a second run on a workspace whose lock is held is refused before doing anything, and so is a stage
    # `dvc repro` runs by hand beside it (issue 63: DVC's own lock is free between the flow's stages)
    with pipeline_lock(ws, "flow run other (pid 1)"):
        with pytest.raises(WorkspaceBusy, match=r"another longctx pipeline run holds this workspace \(flow run other"):
            pipeline(str(ws))
        by_hand = subprocess.run(["dvc", "repro", "eval"], cwd=ws, env=env, capture_output=True, text=True)
    assert by_hand.returncode != 0 and "Traceback" not in by_hand.stdout + by_hand.stderr
    assert re.search(r"^sft: error: the main command runs in this workspace \(flow run other \(pid 1\)\); a stage "
                     r"run beside it would race it", by_hand.stdout + by_hand.stderr, re.M), by_hand.stderr[-2000:]
    assert not (ws / "mlflow.db").exists() and "sft" in sh(["dvc", "status"], ws, env)  # nothing ran

    state = pipeline(str(ws), return_state=True)
    assert state.is_failed()
    with pytest.raises(StageFailed, match=r"eval.lengths: \[100000\] exceed every checkpoint's window"):
        state.result()
    client = MlflowClient(f"sqlite:///{ws / 'mlflow.db'}")
    exp = client.get_experiment_by_name("longctx")
    parents = client.search_runs([exp.experiment_id], filter_string="tags.`longctx.stage` = 'pipeline'")
    assert len(parents) == 1 and parents[0].info.status == "FAILED"
    # eval refused its params before opening a run; SFT ran and finished, DVC skipped the rest
    assert children(client, parents[0]) == {"sft": "FINISHED"}
    tagged = client.search_runs([exp.experiment_id], filter_string="tags.`longctx.stage` = 'sft'")
    assert tagged[0].data.tags["dvc.lock_md5"] and tagged[0].data.tags["git.commit"]

    (ws / "params.yaml").write_text(yaml.safe_dump(fixed, sort_keys=False))  # the fix
    results = pipeline(str(ws))
    assert set(results) == set(STAGES) and results["eval"]["tasks"]
    parents = client.search_runs([exp.experiment_id], filter_string="tags.`longctx.stage` = 'pipeline'",
                                 order_by=["attributes.start_time DESC"])
    assert len(parents) == 2 and parents[0].info.status == "FINISHED"
    assert parents[0].data.tags["longctx.profile"] == "tiny-scratch" and parents[0].data.tags["git.commit"]
    headline = {"results/base.tasks_at_256", "results/sft.tasks_at_512", "results/sft.ppl_at_512"}
    assert headline <= set(parents[0].data.metrics)
    # the comparison view: every checkpoint x task x length score as one table, and the family figure
    parent_id = parents[0].info.run_id
    assert {"results/scores.json", "results/score_by_family.png"} <= {
        a.path for a in client.list_artifacts(parent_id, "results")}
    table = json.loads(Path(client.download_artifacts(parent_id, "results/scores.json")).read_text())
    assert table["columns"] == ["checkpoint", "task", "length", "score", "n", "lo", "hi", "family"]
    scored = {(c, t, int(n)): v for c, by in results["eval"]["tasks"].items() for t, at in by.items()
              for n, v in at.items()}
    assert {(c, t, n): v for c, t, n, v, *_ in table["data"]} == scored
    assert all(lo <= v <= hi and k >= 1 for _, _, _, v, k, lo, hi, _ in table["data"])
    assert {f for *_, f in table["data"]} >= {"retrieval (passkey, NIAH)"}
    # the run page opens on the final table the main command prints (MLflow shows the description first)
    note = parents[0].data.tags["mlflow.note.content"]
    assert "prompts a task; 95% intervals" in note and "vs base" in note and note.startswith("```")
    assert children(client, parents[0]) == {"eval": "FINISHED"}  # DVC skipped the finished stages
    assert os.path.isfile(ws / "metrics/eval.json")

    # a sweep from the committed pipeline: each DVC experiment reruns what its params touch (eval)
    sh(["git", "add", "-A"], ws, env)
    sh(["git", "commit", "-qm", "pipeline run"], ws, env)
    exps = sweep(str(ws), grid={"eval.samples": [2]})
    assert len(exps) == 1 and exps[0]["params"]["eval"]["samples"] == 2
    assert set(exps[0]["metrics"]) == {"metrics.json"}  # the headline alone (git-tracked; the rest DVC outputs)
    assert exps[0]["metrics"]["metrics.json"]["sft@512"] >= 0
    # the experiment's stage (eval alone) under one run named after it
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`dvc.experiment` = '{exps[0]['name']}'")
    named = {r.info.run_name: r for r in runs}
    assert set(named) == {"eval", exps[0]["name"]} and named[exps[0]["name"]].info.status == "FINISHED"
    assert named["eval"].data.tags["mlflow.parentRunId"] == named[exps[0]["name"]].info.run_id
    table = client.search_runs([exp.experiment_id], filter_string="tags.`longctx.stage` = 'sweep'")
    assert len(table) == 1 and "sweep_comparison.md" in {a.path for a in client.list_artifacts(table[0].info.run_id)}
    # the experiment reran eval alone with more prompts: on the prompts both runs asked, the same answers
    note = Path(client.download_artifacts(table[0].info.run_id, "sweep_comparison.md")).read_text()
    assert f"| {exps[0]['name']} | 2 |" in note and "sft: no difference (0-0) @256, no difference (0-0) @512" in note
    assert re.search(rf"\| {exps[0]['name']} \| 2 \| sft @512: \d\.\d\d \[\d\.\d\d-\d\.\d\d\] \(\d+\) \|", note)
    compare.main([exps[0]["name"], "HEAD", "--workspace", str(ws)])  # the `dvc exp show` route's pairing
    assert "| sft | no difference (0-0) | no difference (0-0) |" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stop:
        compare.main(["no-such-exp", "HEAD", "--workspace", str(ws)])
    assert stop.value.code == 2 and "no-such-exp: no git revision or DVC experiment" in capsys.readouterr().err


def test_the_flow_tracks_where_params_say(tmp_path, monkeypatch, harness):
    """params' tracking.uri and tracking.experiment hold under Prefect as under `dvc repro`: the
    pipeline's parent run and its stages' runs land in that store and experiment, nothing in the
    default store."""
    ws = tmp_path / "ws"
    env = dvc_workspace(ws, {**SMALL, "tracking": {"uri": "sqlite:///elsewhere.db", "experiment": "mine"}})
    monkeypatch.setenv("PYTHONPATH", env["PYTHONPATH"])
    assert set(pipeline(str(ws), stages=["corpora"])) == {"corpora"}
    assert not (ws / "mlflow.db").exists()
    client = MlflowClient(f"sqlite:///{ws / 'elsewhere.db'}")
    exp = client.get_experiment_by_name("mine")
    parents = client.search_runs([exp.experiment_id], filter_string="tags.`longctx.stage` = 'pipeline'")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert children(client, parents[0]) == {"corpora": "FINISHED"}
    assert client.get_experiment_by_name("longctx") is None


def test_the_gpu_limit_is_made_one_slot_per_gpu_and_a_users_is_kept(monkeypatch, harness):
    from prefect.client.orchestration import get_client

    monkeypatch.delenv("LONGCTX_GPUS", raising=False)
    assert ensure_gpu_limit() is None  # no GPUs named: no limit to queue on
    monkeypatch.setenv("LONGCTX_GPUS", "0,1,3")
    with get_client(sync_client=True) as client:
        if any(lim.name == GPU_LIMIT for lim in client.read_global_concurrency_limits()):
            client.delete_global_concurrency_limit_by_name(GPU_LIMIT)
        assert "3 slot(s)" in ensure_gpu_limit()
        assert client.read_global_concurrency_limit_by_name(GPU_LIMIT).limit == 3
        client.upsert_global_concurrency_limit_by_name(GPU_LIMIT, 2)  # the user's own choice
        assert "(2 slots)" in ensure_gpu_limit()
        assert client.read_global_concurrency_limit_by_name(GPU_LIMIT).limit == 2
        client.delete_global_concurrency_limit_by_name(GPU_LIMIT)
