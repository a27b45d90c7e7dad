"""MLflow's UI opens on the runs: the address the main command prints, loaded in headless Chromium
from `mlflow ui` serving a store the pipeline wrote (issue 32's GPU run 9), shows the experiment's
run tree, where the experiment's plain address shows MLflow 3.17's GenAI overview with no data.
Chromium: Debian's package (`.ci/run` installs it where it can); without it the test skips."""

from __future__ import annotations

import gzip
import os
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import REPO
from pipelines.__main__ import mlflow_ui, runs_page

# gzipped for the carry
STORE = REPO / "bench/results/pipeline-gpu/pipeline-gpu-nvidia-h100-2026-11-27/llama-run9/mlflow.db.gz"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def page_text(url: str, profile) -> str:
    """The page's visible text once its scripts ran (Chromium's rendered DOM, tags stripped)."""
    done = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=20000",
                           "--dump-dom", url], capture_output=True, text=True, timeout=180)
    html = re.sub(r"<(script|style)[^>]*>.*?</\1>", " ", done.stdout, flags=re.S)
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html))


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium (Debian package chromium)")
def test_the_printed_address_opens_the_run_tree(tmp_path):
    with gzip.open(STORE) as packed, open(tmp_path / "mlflow.db", "wb") as store:
        shutil.copyfileobj(packed, store)
    with sqlite3.connect(tmp_path / "mlflow.db") as db:
        (experiment,) = db.execute("select experiment_id from experiments where name = 'longctx'").fetchone()
        (parent,) = db.execute("select r.name from runs r join tags t on t.run_uuid = r.run_uuid "
                               "where t.key = 'longctx.stage' and t.value = 'pipeline'").fetchone()
        runs = db.execute("select count(*) from runs where experiment_id = ?", (experiment,)).fetchone()[0]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = mlflow_ui(f"sqlite:///{tmp_path / 'mlflow.db'}").split()
    server = subprocess.Popen([sys.executable, "-m", "mlflow", *command[1:], "--port", str(port)], cwd=tmp_path,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(base, timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline and server.poll() is None, "mlflow ui did not start"
                time.sleep(1)
        shown = page_text(f"{base}/{runs_page(str(experiment))}", tmp_path / "a")
        assert parent in shown and f"{runs} matching runs" in shown and "Run Name" in shown
        assert "No data available" not in shown
        plain = page_text(f"{base}/#/experiments/{experiment}", tmp_path / "b")  # what the address avoids
        assert "No data available" in plain and parent not in plain
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the server and its workers
        server.wait(timeout=30)
