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
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import prefect
from prefect.events.worker import EventsWorker
from prefect.logging.handlers import APILogWorker
from prefect.settings import PREFECT_API_URL, temporary_settings


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def prefect_api() -> Iterator[str]:
    """PREFECT_API_URL's server when one is set; else a temporary one (the same app Prefect's
    ephemeral mode serves, on the same database), its URL in force while the block runs."""
    if url := os.environ.get("PREFECT_API_URL"):
        yield url
        return
    port = _free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
    server = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "--app-dir", str(prefect.__module_path__.parent), "--factory",
         "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(port), "--log-level",
         "error", "--lifespan", "on"], env=env, start_new_session=True, preexec_fn=_die_with_parent)
    try:
        _wait_healthy(server, url, float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", 180)))
        with temporary_settings(updates={PREFECT_API_URL: url}):
            try:
                yield url
            finally:  # the flow's queued logs and events, while the server still answers (else
                # Prefect's exit hooks retry a stopped server for over a minute)
                APILogWorker.drain_all(timeout=5)
                EventsWorker.drain_all(timeout=5)
    finally:
        _stop(server)


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


def _stop(server: subprocess.Popen) -> None:
    if server.poll() is not None:
        return
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
