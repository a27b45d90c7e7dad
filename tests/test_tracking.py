"""The workspace's MLflow store where users put it: a workspace moved (or copied) with its store
keeps its runs' artifacts, and new runs write theirs under the new place. A stopped pipeline
leaves no run RUNNING."""

from __future__ import annotations

import shutil
import sqlite3

import pytest

from longctx.config import TrackingParams
from longctx.tracking.runs import end_run, open_run, stage_run
from longctx.tracking.tracker import PARENT_ENV


def test_a_moved_workspace_keeps_its_artifacts_where_it_now_is(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    first, moved = tmp_path / "ws1", tmp_path / "elsewhere" / "ws2"
    first.mkdir()
    for ws, text in ((first, "before the move"), (moved, "after the move")):
        monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # (mlflow sets it in-process)
        note = ws / "note.txt"
        note.write_text(text)
        with stage_run(TrackingParams(), ws, "pack", {"seed": 0}) as tracker:
            tracker.artifact(note)
        if ws is first:
            moved.parent.mkdir()
            shutil.move(first, moved)
    assert not first.exists()  # not recreated by the second run
    client = MlflowClient(f"sqlite:///{moved / 'mlflow.db'}")
    exp = client.get_experiment_by_name("longctx")
    assert exp.artifact_location == (moved / "mlartifacts").as_uri()
    runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])
    assert len(runs) == 2
    for run, text in zip(runs, ("before the move", "after the move"), strict=True):
        assert run.info.artifact_uri.startswith((moved / "mlartifacts").as_uri())
        local = client.download_artifacts(run.info.run_id, "note.txt", str(tmp_path))
        assert open(local).read() == text


def test_runs_a_stopped_pipeline_left_running_end_killed(tmp_path, monkeypatch, capsys):
    """Ctrl-C while another writer holds the store's lock (a write the signal cut short): the stage
    still stops on the interrupt, saying its run stays RUNNING; a stage killed outright leaves its run
    and its curriculum stage's RUNNING. The pipeline's run, ending failed, marks them all KILLED."""
    from mlflow.tracking import MlflowClient

    cfg = TrackingParams()
    parent = open_run(cfg, tmp_path, "pipeline", "pipeline")
    monkeypatch.setenv(PARENT_ENV, parent)
    with pytest.raises(KeyboardInterrupt), stage_run(cfg, tmp_path, "base", {"seed": 0}) as tracker:
        tracker.metrics({"loss": 1.0}, step=1)
        db = sqlite3.connect(tmp_path / "mlflow.db", isolation_level=None)
        db.execute("BEGIN IMMEDIATE")  # no other writer until it ends (MLflow waits 20 s)
        raise KeyboardInterrupt
    db.execute("ROLLBACK")
    assert "tracking: the run was left RUNNING in MLflow (" in capsys.readouterr().err
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_run(parent).info.experiment_id
    killed = client.create_run(experiment, run_name="pretrain", tags={"mlflow.parentRunId": parent}).info.run_id
    client.create_run(experiment, run_name="pretrain_stage1", tags={"mlflow.parentRunId": killed})
    client.create_run(experiment, run_name="another pipeline's")
    end_run(cfg, tmp_path, parent, ok=False)
    status = {r.info.run_name: r.info.status for r in client.search_runs([experiment])}
    assert status == {"pipeline": "FAILED", "base": "KILLED", "pretrain": "KILLED", "pretrain_stage1": "KILLED",
                      "another pipeline's": "RUNNING"}, status


def test_step_metrics_reach_the_store_together_and_every_one(tmp_path, monkeypatch):
    import mlflow
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    # nothing written after the first but by the end
    monkeypatch.setattr("longctx.tracking.tracker.FLUSH_SECONDS", 3600.0)
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    with stage_run(TrackingParams(), tmp_path, "base", {"seed": 0}, section="train") as tracker:
        run = mlflow.active_run().info.run_id
        for step in range(1, 51):
            tracker.metrics({"loss": 1.0 / step, "tokens_per_s": 100.0 * step}, step=step)
        assert [m.step for m in client.get_metric_history(run, "train/loss")] == [1]  # the first at once
        tracker.metrics({"val_loss": 0.5})  # (no step: written now)
        assert len(client.get_metric_history(run, "train/val_loss")) == 1
    for key, value in (("train/loss", lambda s: 1.0 / s), ("train/tokens_per_s", lambda s: 100.0 * s)):
        history = sorted(client.get_metric_history(run, key), key=lambda m: m.step)
        assert [(m.step, m.value) for m in history] == [(s, value(s)) for s in range(1, 51)]
    with stage_run(TrackingParams(), tmp_path, "pretrain", {"seed": 0}, section="train") as tracker:
        parent = mlflow.active_run().info.run_id
        tracker.metrics({"loss": 9.0}, step=1)
        with tracker.nested("pretrain_stage1", {}) as child:
            stage = mlflow.active_run().info.run_id
            for step in range(1, 4):
                child.metrics({"loss": float(step)}, step=step)
        tracker.metrics({"loss": 8.0}, step=2)  # kept, then written at the parent's end
    assert [(m.step, m.value) for m in client.get_metric_history(stage, "train/loss")] == [(1, 1.0), (2, 2.0), (3, 3.0)]
    assert sorted((m.step, m.value) for m in client.get_metric_history(parent, "train/loss")) == [(1, 9.0), (2, 8.0)]


def test_a_dvc_experiments_stages_are_children_of_one_run_named_after_it(tmp_path, monkeypatch):
    """DVC sets DVC_EXP_NAME in each stage of a `dvc exp run`: the first stage makes the
    experiment's run, the later ones join it, and it ends as the stage that ran last did; under
    the Prefect pipeline (its parent run set) no experiment run is made."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("DVC_EXP_NAME", "bulky-lynx")
    monkeypatch.setenv("DVC_EXP_BASELINE_REV", "abc123")
    cfg = TrackingParams()
    with stage_run(cfg, tmp_path, "pack", {"seed": 0}):
        pass
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("longctx").experiment_id
    (parent,) = client.search_runs([experiment], filter_string="tags.`longctx.stage` = 'experiment'")
    assert parent.info.run_name == "bulky-lynx" and parent.info.status == "FINISHED"
    assert parent.data.tags["dvc.experiment"] == "bulky-lynx" and parent.data.tags["dvc.baseline_rev"] == "abc123"
    with pytest.raises(RuntimeError), stage_run(cfg, tmp_path, "eval", {"seed": 0}):
        assert client.get_run(parent.info.run_id).info.status == "RUNNING"  # while a stage of it runs
        raise RuntimeError("eval failed")
    runs = {r.info.run_name: r for r in client.search_runs([experiment])}
    assert set(runs) == {"bulky-lynx", "pack", "eval"}
    assert all(runs[s].data.tags["mlflow.parentRunId"] == parent.info.run_id for s in ("pack", "eval"))
    assert runs["bulky-lynx"].info.status == "FAILED" and runs["eval"].info.status == "FAILED"
    pipeline = open_run(cfg, tmp_path, "pipeline", "pipeline")
    monkeypatch.setenv(PARENT_ENV, pipeline)
    with stage_run(cfg, tmp_path, "sft", {"seed": 0}):
        pass
    (sft,) = client.search_runs([experiment], filter_string="attributes.run_name = 'sft'")
    assert sft.data.tags["mlflow.parentRunId"] == pipeline
    assert len(client.search_runs([experiment], filter_string="tags.`longctx.stage` = 'experiment'")) == 1
