"""The workspace's MLflow store where users put it: a workspace moved (or copied) with its store
keeps its runs' artifacts, and new runs write theirs under the new place."""

from __future__ import annotations

import shutil

from longctx.config import TrackingParams
from longctx.tracking import stage_run


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
