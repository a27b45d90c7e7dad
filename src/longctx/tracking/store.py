"""Where runs go: the workspace's SQLite store (<workspace>/mlflow.db, with artifacts in
<workspace>/mlartifacts, at absolute paths, so every stage of a pipeline writes to the same place
whatever directory it runs in), or MLFLOW_TRACKING_URI or params `tracking.uri`; and the
experiment in it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

from ..config import TrackingParams
from ..errors import ConfigError, DataError


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
