"""What a stage logs (Tracker), and how recording stops, not the stage, when the store stops
answering or taking writes."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..plotting import pyplot

FLUSH_SECONDS = 2.0
"""How often a training stage's per-step metrics reach the store (MLflow's charts lag by as much)."""
PARENT_ENV = "LONGCTX_MLFLOW_PARENT_RUN"
"""The pipeline's MLflow run id, set by the Prefect flow for the stages it starts."""


class Tracker:
    """What a stage logs; a disabled tracker accepts the same calls and records nothing. Metric
    keys are written `<section>/<key>`: one key is one quantity across the experiment (a pack's
    tokens/s is `pack/tokens_per_s`, training's `train/tokens_per_s` in every training stage), and
    MLflow's chart view groups each section."""

    def __init__(self, mlflow=None, section: str | None = None, mirror: str | None = None):
        if mlflow is not None and not section:
            raise ValueError("a recording tracker needs the section its metric keys go under")
        self._mlflow = mlflow
        self.section = section
        self.mirror = mirror
        """A parent run that ends as this run does (a DVC experiment's: it ends as its last stage did)."""
        active = mlflow.active_run() if mlflow is not None else None
        self.run = active.info.run_id if active else None
        """The run it records to (figures go there even while a nested run is the active one)."""
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
        """A figure (`make` builds it, only when recording) as an image artifact `name` of this
        tracker's run, also while a run nested in it is active (pretrain's shows each curriculum
        stage's loss)."""
        if not self._mlflow or _store_lost:
            return
        log_figure(lambda fig: self._record(lambda: self._mlflow.MlflowClient().log_figure(self.run, fig, name)), make)

    def params(self, values: dict[str, str]) -> None:
        self._record("log_params", values)

    def end(self, status: str) -> None:
        self.flush()
        self._record("end_run", status)
        if self.mirror:
            self._record(lambda: self._mlflow.MlflowClient().set_terminated(self.mirror, status))

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
        with ending(Tracker(self._mlflow, self.section)) as child:
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

    from ..io import DISK_ERRNOS

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


@contextlib.contextmanager
def ending(tracker: Tracker) -> Iterator[Tracker]:
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


def log_figure(log: Callable[[Any], None], make: Callable[[], Any]) -> None:
    """Build a figure, log it, and free it whatever the logging does."""
    fig = make()
    try:
        log(fig)
    finally:
        pyplot().close(fig)

