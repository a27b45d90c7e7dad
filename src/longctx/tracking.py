"""MLflow helpers: one run per stage execution, with params, metrics, plots and manifests.

The store defaults to SQLite at an absolute path inside the project (<root>/mlflow.db, with
artifacts in <root>/mlartifacts), so every stage of a pipeline writes to the same place
whatever directory it runs in. MLFLOW_TRACKING_URI or params `tracking.uri` override it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .config import TrackingParams
from .errors import ConfigError, DataError
from .plotting import pyplot

MAX_PARAM_CHARS = 6000
FLUSH_SECONDS = 2.0
"""How often a training stage's per-step metrics reach the store (MLflow's charts lag by as much)."""
PARENT_ENV = "LONGCTX_MLFLOW_PARENT_RUN"
"""The pipeline's MLflow run id, set by the Prefect flow for the stages it starts."""


def workspace_root(root: Path) -> Path:
    """The user's workspace: `dvc exp run --temp` and queued experiments run the stages in a copy
    under <workspace>/.dvc/tmp/exps/; their runs belong in the workspace's store, not the copy's."""
    parts = root.resolve().parts
    for i in range(len(parts) - 3):
        if parts[i:i + 3] == (".dvc", "tmp", "exps"):
            return Path(*parts[:i])
    return root


PROBE_SECONDS = 5.0
"""How long a tracking server has to answer before a stage starts (MLflow's own client retries
for minutes, silently)."""
HTTP_LIMITS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}
"""A server that stops answering during a run fails its next call within about a minute."""


def tracking_uri(cfg: TrackingParams, root: Path) -> str:
    """The store runs go to: MLFLOW_TRACKING_URI, else tracking.uri, else <workspace>/mlflow.db.
    A server that does not answer is an error naming it (ConfigError), or, with
    tracking.unreachable: local, the local store, said on stderr."""
    root = workspace_root(root)
    local = _local_store(root)
    uri = os.environ.get("MLFLOW_TRACKING_URI") or cfg.uri or local
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        uri = "sqlite:///" + str((root / uri.removeprefix("sqlite:///")).resolve())
    if uri.startswith(("http://", "https://")):
        for key, value in HTTP_LIMITS.items():
            os.environ.setdefault(key, value)
        if why := _silent(uri):
            if cfg.unreachable == "local":
                _say_once(f"tracking: {uri} does not answer ({why}); recording in {local} instead")
                return local
            raise ConfigError(f"tracking.uri: the MLflow server at {uri} does not answer ({why}); start it, fix "
                              "the URI (MLFLOW_TRACKING_URI or tracking.uri), or set tracking.unreachable: local")
    return uri


@functools.cache
def _silent(uri: str) -> str | None:
    """Why the MLflow server at `uri` does not answer its health check, or None if it does."""
    try:
        urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=PROBE_SECONDS).close()
    except urllib.error.HTTPError:
        return None  # it answered (an older server without /health, or a proxy's page)
    except (urllib.error.URLError, OSError, ValueError) as e:
        return str(getattr(e, "reason", e))
    return None


@functools.cache
def _say_once(message: str) -> None:
    print(message, file=sys.stderr)


class Tracker:
    """What a stage logs; a disabled tracker accepts the same calls and records nothing. Metric
    keys are written `<section>/<key>`: one key is one quantity across the experiment (a pack's
    tokens/s is `pack/tokens_per_s`, training's `train/tokens_per_s` in every training stage), and
    MLflow's chart view groups each section."""

    def __init__(self, mlflow=None, section: str | None = None):
        if mlflow is not None and not section:
            raise ValueError("a recording tracker needs the section its metric keys go under")
        self._mlflow = mlflow
        self.section = section
        self._steps: list = []
        """Per-step metrics not yet written (mlflow Metric entries, with their run)."""
        self._flushed = 0.0

    def _record(self, call: str | Callable, *args, **kwargs) -> None:
        """One call of mlflow's (by name, or a function using it); a tracking server that stops
        answering mid-run, or a store whose disk fills or turns read-only, is said once and
        recording stops there: the stage goes on (its numbers are in metrics/ and runs/), rather
        than hours of training ending in a traceback."""
        if not self._mlflow or _store_lost:
            return
        try:
            with _store_log_quiet():
                (getattr(self._mlflow, call) if isinstance(call, str) else call)(*args, **kwargs)
        except Exception as e:
            if not _lost_store(e):
                raise

    def metrics(self, values: dict[str, float], step: int | None = None) -> None:
        """Metrics, now; those of a `step` are written together every FLUSH_SECONDS (and when the
        run ends): a store write per training step (6 ms on SQLite) made a host-bound stage slower."""
        clean = {f"{self.section}/{k}": float(v) for k, v in values.items() if isinstance(v, (int, float))}
        if step is None:
            self._record("log_metrics", clean)
            return
        active = self._mlflow.active_run() if self._mlflow and not _store_lost else None
        if active is None:
            return
        from mlflow.entities import Metric

        run, now = active.info.run_id, time.time()
        self._steps += [(run, Metric(k, v, int(now * 1000), step)) for k, v in clean.items()]
        if now - self._flushed >= FLUSH_SECONDS:
            self.flush()

    def flush(self) -> None:
        """Write the per-step metrics kept so far (kept for the next try if the store refuses)."""
        self._flushed = time.time()
        for run in dict.fromkeys(r for r, _ in self._steps):
            entries = [m for r, m in self._steps if r == run]
            self._record(lambda run=run, entries=entries: self._mlflow.MlflowClient().log_batch(run, metrics=entries))
            self._steps = [(r, m) for r, m in self._steps if r != run]

    def artifact(self, path: Path, folder: str | None = None) -> None:
        if Path(path).exists():
            self._record("log_artifacts" if Path(path).is_dir() else "log_artifact", str(path), folder)

    def text(self, text: str, name: str) -> None:
        self._record("log_text", text, name)

    def figure(self, make: Callable[[], Any], name: str) -> None:
        """A figure (`make` builds it, only when recording) as an image artifact `name`."""
        if not self._mlflow or _store_lost:
            return
        _log_figure(lambda fig: self._record("log_figure", fig, name), make)

    def params(self, values: dict[str, str]) -> None:
        self._record("log_params", values)

    def end(self, status: str) -> None:
        self.flush()
        self._record("end_run", status)

    @contextlib.contextmanager
    def nested(self, name: str, tags: dict[str, str]) -> Iterator[Tracker]:
        """A child run of this one (a curriculum stage of pretrain: its own loss curve from step
        1 and its own final values, not one run's keys written twice); ends FAILED if the body
        raises."""
        if not self._mlflow or _store_lost:
            yield Tracker()
            return
        try:
            parent = self._mlflow.active_run()  # the stage's run: its experiment, its tags
            inherited = {k: v for k, v in parent.data.tags.items() if not k.startswith("mlflow.")}
            self._mlflow.start_run(experiment_id=parent.info.experiment_id, run_name=name, nested=True,
                                   tags=inherited | tags)
        except Exception as e:
            if not _lost_store(e):
                raise
        with _ending(Tracker(self._mlflow, self.section)) as child:
            yield child


_store_lost = False


STORE_DISK_ERRORS = ("database or disk is full", "readonly database", "disk I/O error", "No space left on device",
                     "Read-only file system", "Disk quota exceeded")
"""How SQLite (through SQLAlchemy and MLflow) and the artifact store say their disk refused a write."""


def _lost_store(error: Exception) -> bool:
    """Whether `error` is a remote tracking server gone silent, or a store whose disk stopped
    taking writes (then said once, and no more calls are made in this process: the run stays
    RUNNING until the next process that records ends it, end_orphans); False for anything else,
    which the caller raises."""
    global _store_lost
    import mlflow
    import requests

    from .io import DISK_ERRNOS

    uri = mlflow.get_tracking_uri()
    remote = uri.startswith(("http://", "https://"))
    transport = isinstance(error, (requests.RequestException, OSError)) or "API request to" in str(error)
    disk = (isinstance(error, OSError) and error.errno in DISK_ERRNOS) or any(
        m in str(error) for m in STORE_DISK_ERRORS)
    if not (remote and transport or disk):
        return False
    if not _store_lost:
        _store_lost = True
        what = f"the MLflow server at {uri} stopped answering" if remote and transport else \
            f"the MLflow store {uri.removeprefix('sqlite:///')} stopped taking writes"
        lines = [line for line in str(error).splitlines() if line.strip()]
        reason = next((line for line in lines if any(m in line for m in STORE_DISK_ERRORS)),
                      lines[0] if lines else type(error).__name__)[:200]
        logging.getLogger(STORE_LOG).setLevel(logging.CRITICAL)  # (MLflow's own end of the run at exit, too)
        print(f"tracking: {what} ({reason}); the stage goes on without recording to it (its numbers are in metrics/ "
              "and runs/; the next stage that records ends this run)", file=sys.stderr)
    return True


STORE_LOG = "mlflow.store.db.utils"
"""The logger MLflow's SQL store writes each failed statement's traceback to before raising it."""


@contextlib.contextmanager
def _store_log_quiet() -> Iterator[None]:
    """MLflow's SQL store silent for one call: what it raises is said once (_lost_store) or raised."""
    log = logging.getLogger(STORE_LOG)
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(max(level, log.level) if _store_lost else level)


PROCESS_TAG = "longctx.process"
"""host:pid of the process that started a run: a later process ends the run if that one is gone."""


def end_orphans(client, experiment: str) -> list[str]:
    """Runs still RUNNING whose process (PROCESS_TAG, on this host) has ended without ending them
    (killed outright, or its store stopped taking writes mid-run): ended FAILED, with a tag saying
    so. Returns their ids."""
    from .io import _running

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


@contextlib.contextmanager
def _ending(tracker: Tracker) -> Iterator[Tracker]:
    """The tracker's active run ends FINISHED, KILLED if the body is interrupted (Ctrl-C,
    SIGTERM), or FAILED if it raises."""
    try:
        yield tracker
    except KeyboardInterrupt:
        try:
            tracker.end("KILLED")
        except Exception as e:  # a store write the signal cut short can hold SQLite's lock past its timeout
            then = "; the pipeline's run marks it KILLED when it ends" if os.environ.get(PARENT_ENV) else ""
            print(f"tracking: the run was left RUNNING in MLflow ({str(e).splitlines()[0][:160]}){then}",
                  file=sys.stderr)
        raise
    except BaseException:
        tracker.end("FAILED")
        raise
    tracker.end("FINISHED")


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
    if os.environ.get("DVC_EXP_NAME"):
        tags["dvc.experiment"] = os.environ["DVC_EXP_NAME"]
    return tags


EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}
"""MLflow 3 opens an experiment without this tag in its GenAI view (an empty traces page); with
it, in the model-training view (runs, charts)."""


def experiment_id(cfg: TrackingParams, root: Path) -> str:
    """The configured experiment in the configured store, made on first use with its artifacts in
    the workspace's mlartifacts/, marked as model training (EXPERIMENT_KIND)."""
    import mlflow

    uri = check_store(cfg, root)
    mlflow.set_tracking_uri(uri)
    store = (workspace_root(root) / "mlartifacts").resolve().as_uri()
    try:
        exp = mlflow.get_experiment_by_name(cfg.experiment)
    except Exception as e:  # a SQLite file corrupt past its header: MLflow's error is a page of SQLAlchemy's
        if uri.startswith("sqlite:///") and "not a database" in str(e):
            raise _not_a_store(uri) from None
        raise
    if exp is not None:
        moved = exp.artifact_location != store and exp.artifact_location.endswith("/mlartifacts")
        if moved and uri == _local_store(root):
            _move_artifacts_location(uri, exp.experiment_id, exp.artifact_location, store)
        return exp.experiment_id
    return mlflow.create_experiment(cfg.experiment, artifact_location=store, tags=EXPERIMENT_KIND)


SQLITE_HEADER = b"SQLite format 3\x00"


def check_store(cfg: TrackingParams, root: Path) -> str:
    """The store's URI once it is known to take runs: a server that answers (tracking_uri), or a
    SQLite file that is one or is still to be made. Checked by the main command before anything
    runs (MLflow's client, handed a junk mlflow.db, printed pages of SQLAlchemy tracebacks)."""
    uri = tracking_uri(cfg, root)
    if uri.startswith("sqlite:///"):
        path = Path(uri.removeprefix("sqlite:///"))
        if path.is_file() and path.stat().st_size:
            with path.open("rb") as fh:
                if fh.read(len(SQLITE_HEADER)) != SQLITE_HEADER:
                    raise _not_a_store(uri)
    return uri


def local_folders(cfg: TrackingParams, root: Path) -> list[Path]:
    """The folders a local store writes to: the SQLite file's and the workspace's mlartifacts/
    (none for a server, or with tracking off). A stage checks they take writes before its work."""
    uri = os.environ.get("MLFLOW_TRACKING_URI") or cfg.uri or _local_store(root)
    if not cfg.enabled or not uri.startswith("sqlite:///"):
        return []
    return [Path(tracking_uri(cfg, root).removeprefix("sqlite:///")).parent, workspace_root(root) / "mlartifacts"]


def _not_a_store(uri: str) -> DataError:
    return DataError(f"{uri.removeprefix('sqlite:///')}: not an MLflow store (file is not a database); "
                     "move it aside (a new one is made) or set tracking.enabled: false")


def _local_store(root: Path) -> str:
    return f"sqlite:///{(workspace_root(root) / 'mlflow.db').resolve()}"


def _move_artifacts_location(uri: str, experiment: str, old: str, new: str) -> None:
    """A workspace moved or copied with its store: the experiment's artifacts (and every run's)
    point at the old workspace's mlartifacts/, where new runs would recreate it (or fail). MLflow
    has no call to change an experiment's artifact location, so the workspace's own SQLite store
    is updated, runs' URIs with it (their files moved along with mlartifacts/)."""
    import sqlite3

    with contextlib.closing(sqlite3.connect(uri.removeprefix("sqlite:///"))) as db, db:
        db.execute("UPDATE experiments SET artifact_location = ? WHERE experiment_id = ?", (new, int(experiment)))
        db.execute("UPDATE runs SET artifact_uri = ? || substr(artifact_uri, ?) WHERE experiment_id = ? AND "
                   "substr(artifact_uri, 1, ?) = ?", (new, len(old) + 1, int(experiment), len(old), old))


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
    # under the Prefect pipeline each stage is a child of the pipeline run's MLflow run
    parent = os.environ.get(PARENT_ENV)
    mlflow.start_run(experiment_id=exp_id, run_name=stage, tags=run_tags(root, stage), parent_run_id=parent)
    with _ending(Tracker(mlflow, section or stage)) as tracker:
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


def _log_figure(log: Callable[[Any], None], make: Callable[[], Any]) -> None:
    """Build a figure, log it, and free it whatever the logging does."""
    fig = make()
    try:
        log(fig)
    finally:
        pyplot().close(fig)


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
        _log_figure(lambda fig, name=name: client.log_figure(run_id, fig, name), make)
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
