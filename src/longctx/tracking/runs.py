"""The runs: a stage's (a child of the pipeline's run when the Prefect flow starts it, of the
experiment's under `dvc exp run`), the pipeline's parent run, and the ends of both, including
those of runs whose process died."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..config import TrackingParams
from .store import experiment_id, tracking_uri
from .tracker import PARENT_ENV, Tracker, ending, log_figure

MAX_PARAM_CHARS = 6000


PROCESS_TAG = "longctx.process"
"""host:pid of the process that started a run: a later process ends the run if that one is gone."""


def end_orphans(client, experiment: str) -> list[str]:
    """Runs still RUNNING whose process (PROCESS_TAG, on this host) has ended without ending them
    (killed outright, or its store stopped taking writes mid-run): ended FAILED, with a tag saying
    so. Returns their ids."""
    from ..io import _running

    host = socket.gethostname()
    query = f"attributes.status = 'RUNNING' and tags.`{PROCESS_TAG}` LIKE '{host}:%'"
    ended = []
    for r in client.search_runs([experiment], filter_string=query):
        pid = r.data.tags[PROCESS_TAG].rpartition(":")[2]
        if pid.isdigit() and not _running(int(pid)):
            client.set_tag(r.info.run_id, "longctx.ended_by", f"{host}:{os.getpid()}: its process {pid} had ended "
                           "without ending the run")
            client.set_terminated(r.info.run_id, "FAILED")
            ended.append(r.info.run_id)
    return ended


def git_commit(root: Path) -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def run_tags(root: Path, stage: str) -> dict[str, str]:
    """What every run carries: its stage, the code's commit and the DVC experiment it belongs to."""
    tags = {"longctx.stage": stage, PROCESS_TAG: f"{socket.gethostname()}:{os.getpid()}"}
    if commit := git_commit(root):
        tags["git.commit"] = commit
    if os.environ.get(EXPERIMENT_ENV):
        tags["dvc.experiment"] = os.environ[EXPERIMENT_ENV]
    return tags


EXPERIMENT_ENV = "DVC_EXP_NAME"
"""The experiment's name, which DVC 3 sets (with DVC_EXP_BASELINE_REV) in every stage a `dvc exp
run` runs, in the workspace, a temporary copy or the queue (dvc/repo/experiments/queue/base.py)."""


def experiment_run(client, experiment: str, root: Path) -> str | None:
    """The parent run of the DVC experiment this stage runs in, named after it and made by its
    first stage (None outside `dvc exp run`): the experiment's stages are its children, as the
    main command's are the flow run's. RUNNING while a stage runs, tagged with that stage's process
    (end_orphans fails it if the process dies), then ending as the stage did."""
    name = os.environ.get(EXPERIMENT_ENV)
    if not name:
        return None
    tags = run_tags(root, "experiment") | {"dvc.baseline_rev": os.environ.get("DVC_EXP_BASELINE_REV", "")}
    query = f"tags.`longctx.stage` = 'experiment' and tags.`dvc.experiment` = '{name}'"
    for found in client.search_runs([experiment], filter_string=query, max_results=1):
        client.update_run(found.info.run_id, "RUNNING")
        client.set_tag(found.info.run_id, PROCESS_TAG, tags[PROCESS_TAG])
        return found.info.run_id
    return client.create_run(experiment, run_name=name, tags=tags).info.run_id


@contextlib.contextmanager
def stage_run(cfg: TrackingParams, root: Path, stage: str, params: dict[str, Any],
              section: str | None = None) -> Iterator[Tracker]:
    """An MLflow run for one stage, its metrics under `section` (default: the stage's name); it
    ends FAILED if the stage raises."""
    if not cfg.enabled:
        yield Tracker()
        return
    import mlflow

    exp_id = experiment_id(cfg, root)
    end_orphans(mlflow.MlflowClient(), exp_id)
    # a child of the Prefect pipeline's run, else of the DVC experiment's
    experiment = None if os.environ.get(PARENT_ENV) else experiment_run(mlflow.MlflowClient(), exp_id, root)
    parent = os.environ.get(PARENT_ENV) or experiment
    mlflow.start_run(experiment_id=exp_id, run_name=stage, tags=run_tags(root, stage), parent_run_id=parent)
    with ending(Tracker(mlflow, section or stage, mirror=experiment)) as tracker:
        items = [(k, str(v)[:MAX_PARAM_CHARS]) for k, v in params.items()]
        for i in range(0, len(items), 100):
            tracker.params(dict(items[i:i + 100]))
        yield tracker


def open_run(cfg: TrackingParams, root: Path, stage: str, name: str, tags: dict[str, str] | None = None) -> str | None:
    """A run that outlives this call (a pipeline's parent run, which its stages' runs join through
    PARENT_ENV; end it with `end_run`); None when tracking is off."""
    if not cfg.enabled:
        return None
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri(cfg, root))
    end_orphans(client, experiment_id(cfg, root))
    return client.create_run(experiment_id(cfg, root), run_name=name,
                             tags=run_tags(root, stage) | (tags or {})).info.run_id


def end_run(cfg: TrackingParams, root: Path, run_id: str | None, ok: bool, text: dict[str, str] | None = None,
            metrics: dict[str, float] | None = None, tables: dict[str, dict[str, list]] | None = None,
            figures: dict[str, Callable[[], Any]] | None = None, description: str | None = None) -> None:
    """Close a run from `open_run`, FINISHED or FAILED, with `text` files (name: content) attached,
    `metrics` logged (keys as given: the caller names their section), `tables` (name: columns, shown
    as tables in MLflow's artifact view), `figures` (name: a function that builds one) and a
    `description` (Markdown: the first thing MLflow's run page shows)."""
    if run_id is None:
        return
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri(cfg, root))
    if description:
        client.set_tag(run_id, "mlflow.note.content", description)
    for name, content in (text or {}).items():
        client.log_text(run_id, content, name)
    for key, value in (metrics or {}).items():
        client.log_metric(run_id, key, value)
    for name, columns in (tables or {}).items():
        client.log_table(run_id, columns, name)
    for name, make in (figures or {}).items():
        log_figure(lambda fig, name=name: client.log_figure(run_id, fig, name), make)
    if not ok:
        _kill_leftovers(client, run_id)
    client.set_terminated(run_id, "FINISHED" if ok else "FAILED")


def _kill_leftovers(client, parent: str) -> None:
    """Runs under `parent` (and under those) still RUNNING when a pipeline stops short: a stage
    killed outright, or one whose interrupted write kept it from closing its own run."""
    running = client.search_runs([client.get_run(parent).info.experiment_id], "attributes.status = 'RUNNING'")
    under, found = {parent}, True
    while found:
        found = [r for r in running if r.data.tags.get("mlflow.parentRunId") in under and r.info.run_id not in under]
        for r in found:
            client.set_terminated(r.info.run_id, "KILLED")
            under.add(r.info.run_id)


def tag_children(cfg: TrackingParams, root: Path, parent: str | None, stage: str, tags: dict[str, str]) -> None:
    """Tag the runs `stage` made under `parent`."""
    if parent is None:
        return
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri(cfg, root))
    query = f"tags.mlflow.parentRunId = '{parent}' and tags.`longctx.stage` = '{stage}'"
    for r in client.search_runs([experiment_id(cfg, root)], filter_string=query):
        for k, v in tags.items():
            client.set_tag(r.info.run_id, k, v)
