"""The Prefect API the main command's flow reports to. Prefect's own temporary server is a child
in the terminal's process group: Ctrl-C killed it with the flow, which then spent minutes
retrying to record its end and left its run "Running". Started here in a session of its own,
it outlives the interrupt long enough for the flow to record that it crashed, and stops after."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import prefect
from prefect.events.worker import EventsWorker
from prefect.logging.handlers import APILogWorker
from prefect.settings import PREFECT_API_URL, temporary_settings

from longctx.errors import ConfigError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PROBE_SECONDS = 5.0
"""How long PREFECT_API_URL's server has to answer before the run (Prefect's client retries for
minutes, then fails the flow in tracebacks)."""


def check_api() -> None:
    """PREFECT_API_URL, where set, names a Prefect API that answers: its /health says true. Said in
    one line before the run: nothing listening, or another server on that address."""
    if not (url := os.environ.get("PREFECT_API_URL")):
        return
    fix = "start it (`prefect server start`) or unset PREFECT_API_URL (the main command then starts its own)"
    try:
        reply = httpx.get(url.rstrip("/") + "/health", timeout=PROBE_SECONDS)
    except (httpx.HTTPError, ValueError) as e:
        raise ConfigError(f"PREFECT_API_URL={url}: no Prefect server answers there ({e or type(e).__name__}); "
                          f"{fix}") from None
    if reply.status_code != 200 or reply.text.strip() != "true":
        raise ConfigError(f"PREFECT_API_URL={url}: the server there is not a Prefect API (GET /health: HTTP "
                          f"{reply.status_code}, {reply.text.strip()[:60]!r}); point it at one's /api, or unset it")


@contextmanager
def prefect_api() -> Iterator[str]:
    """PREFECT_API_URL's server when one is set; else a temporary one (the same app Prefect's
    ephemeral mode serves, on the same database), its URL in force while the block runs."""
    if url := os.environ.get("PREFECT_API_URL"):
        yield url
        return
    server = _Server(_free_port())
    try:
        server.start()
        with temporary_settings(updates={PREFECT_API_URL: server.url}):
            try:
                yield server.url
            finally:  # the flow's queued logs and events, while the server still answers (else
                # Prefect's exit hooks retry a stopped server for over a minute)
                APILogWorker.drain_all(timeout=5)
                EventsWorker.drain_all(timeout=5)
    finally:
        server.stop()


class _Server:
    """The uvicorn process, and a watchdog that starts it again on the same port and database if
    it dies mid-run (the client's retries ride out the gap; Prefect's own would leave the next
    task Pending for minutes, then fail the run in tracebacks)."""

    def __init__(self, port: int):
        self.port, self.url = port, f"http://127.0.0.1:{port}/api"
        self.proc: subprocess.Popen | None = None
        self.stopping = threading.Event()
        self.timeout = float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", 180))

    def _spawn(self) -> None:
        env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1",
               "PREFECT__SERVER_FINAL": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--app-dir", str(prefect.__module_path__.parent), "--factory",
             "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(self.port),
             "--log-level", "error", "--lifespan", "on"], env=env, start_new_session=True,
            preexec_fn=_die_with_parent)
        _wait_healthy(self.proc, self.url, self.timeout)

    def start(self) -> None:
        self._spawn()
        threading.Thread(target=self._watch, name="prefect-server-watchdog", daemon=True).start()

    def _watch(self) -> None:
        while not self.stopping.wait(0.5):
            if self.proc.poll() is None:
                continue
            print(f"longctx pipeline: the temporary Prefect server exited (code {self.proc.returncode}); "
                  "starting it again", file=sys.stderr, flush=True)
            try:
                self._spawn()
            except RuntimeError as e:
                print(f"longctx pipeline: {e}", file=sys.stderr, flush=True)
                return

    def stop(self) -> None:
        self.stopping.set()
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _die_with_parent() -> None:
    """In the server's process before it starts: on Linux, SIGTERM when the main command dies
    however it dies (its own session keeps the terminal's signals away, and its parent's too)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _wait_healthy(server: subprocess.Popen, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the temporary Prefect server exited with code {server.returncode} before serving")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the temporary Prefect server did not answer within {timeout:.0f} s "
                       "(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS)")
