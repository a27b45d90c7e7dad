"""Shared fixtures: a small but real run of the data stages (stdlib text, trained BPE)."""

from __future__ import annotations

import os

# Idle OpenMP threads sleep instead of spinning (set before torch loads libgomp; every subprocess
# inherits it): with GOMP's default busy-wait the second core of a 2-core machine burnt a third
# more CPU on the suite's small tensors for no speed (test_train + test_long_sequence_memory:
# 142 -> 85 s user, 154 -> 94 s wall)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import atexit  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402

from longctx.config.eval_params import EvalParams  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DVC_NO_ANALYTICS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
if not torch.cuda.is_available():  # Triton kernels run in its interpreter (set before any kernel is defined)
    os.environ.setdefault("TRITON_INTERPRET", "1")
# one launch configuration per FoX kernel: tuning every test shape would take minutes (bench/attention.py tunes)
os.environ.setdefault("LONGCTX_FOX_AUTOTUNE", "0")

# The tiny profile scaled down further so a full corpora -> tokenize -> pack run takes seconds.
SMALL = {
    "profile": "tiny-scratch",
    "corpora": {"domains": {
        "code_repos": {"sources": [{"builtin": "stdlib_repos", "max_bytes": 1_500_000}]},
        "books": {"sources": [{"builtin": "stdlib_books", "max_bytes": 1_000_000}]},
        "docstrings": {"sources": [{"builtin": "stdlib_short", "part": "docstrings", "max_bytes": 300_000}]},
        "modules": {"sources": [{"builtin": "stdlib_short", "part": "modules", "max_bytes": 400_000}]},
        "chat": {"sources": [{"builtin": "stdlib_sft", "max_bytes": 300_000}]},
        "retrieval": {"sources": [{"synthetic": {"min_chars": 100, "max_chars": 900}, "max_bytes": 300_000}]},
        "retrieval_long": {"sources": [{"synthetic": {"min_chars": 300, "max_chars": 1800}, "max_bytes": 200_000}]},
    }},
    "tokenize": {"tokenizer": {"train": {"vocab_size": 1024, "sample_bytes": 1_000_000}},
                 "long_min_tokens": 512, "num_workers": 1, "shard_tokens": 200_000},
    "pack": {"val_fraction": 0.1, "splits": {
        "base": {"seq_len": 256},
        "stage1": {"seq_len": 512},
        "stage2": {"seq_len": 2048, "chunk_len": 512,  # (shares that chunk lengths can meet at this size)
                   "mix": {"code_repos": 0.2, "books": 0.2, "textbooks": 0.03, "shortmix": 0.17, "retrieval_long": 0.4},
                   "lengths": {
            "code_repos": {8192: None, 2048: 0.5, 512: 0.5},
            "books": {8192: None, 2048: 0.17, 512: 0.83},
            "textbooks": {8192: None, 2048: 1.0}}},
        "sft": {"seq_len": 512},
    }},
    "model": {"d_model": 32, "n_layers": 2, "n_heads": 4, "ffn_dim": 64, "max_position_embeddings": 256},
    # every task builder end to end (the tiny profile asks only its four retrieval tasks)
    "eval": {"tasks": list(EvalParams.TASKS), "lengths": [256, 512], "samples": 1, "depths": [0.5],
             "position_sequences": 2, "needle_sequences": 2, "retention_sequences": 4,
             "helmet": {"nq": {"kind": "rag", "path": "helmet/nq.jsonl"}}},
    "rope_search": {"target_length": 512, "population": 6, "generations": 2, "sequences": 2, "table_sequences": 2},
    "train": {
        "base": {"steps": 4, "micro_batch": 2, "val_sequences": 4, "checkpoint_every": 2},
        "pretrain": {"stages": [
            {"split": "stage1", "steps": 2, "lr": 1e-3, "rope_theta": 160000.0, "val_sequences": 2},
            {"split": "stage2", "steps": 2, "lr": 1e-3, "rope_theta": 2560000.0, "val_sequences": 2}]},
        "sft": {"steps": 2, "val_sequences": 2},
    },
}


def write_params(folder: Path, overrides: dict) -> Path:
    path = folder / "params.yaml"
    path.write_text(yaml.safe_dump(overrides, sort_keys=False))
    return path


def stage_process(project: Path, name: str, overrides: dict | None, env: dict[str, str] | None = None,
                  mounts: str | None = None) -> subprocess.CompletedProcess:
    """`python -m stages.<name>` in a project folder with these params (None: its params.yaml as
    it is) and extra environment `env`, as a user runs it; after `mounts` (shell, run in a private
    mount namespace of its own: a full or read-only disk for this process only) if given. Without
    mounts the process is forked from tests/stage_worker.py, which imported the stages' modules once."""
    if overrides is not None:
        write_params(project, overrides)
    env = {**stage_env(), **(env or {})}
    if mounts is None:
        return _stage_worker().run(name, project, env, timeout=600)
    cmd = ["unshare", "--map-root-user", "--mount", "sh", "-ec", f'{mounts}; exec "$@"', "sh",
           sys.executable, "-m", f"stages.{name}"]
    return subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True, timeout=600)


def stage_env() -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


class _StageWorker:
    """The suite's tests/stage_worker.py process (started at the first stage it runs)."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "stage_worker.py")], env=stage_env(),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"tests/stage_worker.py did not start (exit {self.proc.wait()})")

    def run(self, name: str, cwd: Path, env: dict[str, str], timeout: int) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            req = {"stage": name, "cwd": str(cwd), "env": env, "stdout": str(out), "stderr": str(err),
                   "timeout": timeout}
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            answer = self.proc.stdout.readline()
            if not answer:
                raise RuntimeError(f"tests/stage_worker.py exited (code {self.proc.wait()})")
            code = json.loads(answer)["returncode"]
            return subprocess.CompletedProcess([sys.executable, "-m", f"stages.{name}"], code,
                                               out.read_text(), err.read_text())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@functools.cache
def _stage_worker() -> _StageWorker:
    worker = _StageWorker()
    atexit.register(worker.close)
    return worker


GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@example.com"}


def sh(args: list[str], cwd: Path, env: dict) -> str:
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout + proc.stderr


def dvc_workspace(ws: Path, params: dict) -> dict:
    """A clone-like git + DVC workspace of the project's tracked files with these params; returns
    the environment to run its stages with."""
    if shutil.which("dvc") is None:
        pytest.fail("dvc is not installed (it is a project dependency)")
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    for f in files:
        if (REPO / f).is_file():
            (ws / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / f, ws / f)
    (ws / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    env = workspace_env(ws)
    sh(["git", "init", "-q"], ws, env)
    sh(["git", "add", "-A"], ws, env)
    sh(["git", "commit", "-qm", "init"], ws, env)
    return env


def copy_workspace(src: Path, dst: Path, store: bool = True) -> dict:
    """A copy of a git + DVC workspace (its DVC cache and run cache too) at `dst`; returns the
    environment to run its stages with. store=False leaves its MLflow store behind: the copy's
    runs then start a store of their own (the original's experiment names its artifact folder)."""
    left = None if store else shutil.ignore_patterns("mlflow.db", "mlartifacts")
    shutil.copytree(src, dst, symlinks=True, ignore=left)
    return workspace_env(dst)


def workspace_env(ws: Path) -> dict:
    """The environment a workspace's stages run with: its own code, git's identity, and the
    store its params name (no MLFLOW_TRACKING_URI from an in-process test)."""
    env = {**os.environ, **GIT_ENV, "PYTHONPATH": f"{ws / 'src'}{os.pathsep}{ws}"}
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def run_stages(folder: Path, names: list[str], overrides: dict | None = None) -> None:
    """Run stages in-process from `folder` (the stages use paths relative to the project root)."""
    from longctx import config
    from stages import corpora, pack, tokenize

    mods = {"corpora": corpora, "tokenize": tokenize, "pack": pack}
    if overrides is not None:
        write_params(folder, overrides)
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        cfg = config.load("params.yaml")
        for name in names:
            mods[name].run(cfg, folder)
    finally:
        os.chdir(cwd)


@pytest.fixture(autouse=True)
def _own_tracking_uri(monkeypatch):
    """mlflow.set_tracking_uri exports MLFLOW_TRACKING_URI for subprocesses: a test that tracks
    in-process would otherwise point every later test's store at its own."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "")
    monkeypatch.delenv("MLFLOW_TRACKING_URI")


@pytest.fixture(autouse=True)
def _cuda_memory_returned():
    """After a test on CUDA, its cached blocks go back to the device: under pytest-xdist each worker
    otherwise keeps its largest test's memory, and eight workers on one H200 ran out of it (11-43 GiB
    each, 6 CUDA out-of-memory failures; issue 63)."""
    yield
    if torch.cuda.is_initialized():
        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture(scope="session")
def small_project(tmp_path_factory) -> Path:
    """A project folder where corpora, tokenize and pack ran on SMALL, tracked in a temp MLflow."""
    folder = tmp_path_factory.mktemp("project")
    overrides = {**SMALL, "tracking": {"uri": f"sqlite:///{folder / 'mlflow.db'}"}}
    run_stages(folder, ["corpora", "tokenize", "pack"], overrides)
    return folder


@pytest.fixture(scope="session")
def small_run(tmp_path_factory) -> tuple[Path, str]:
    """SMALL through the main command (`python -m pipelines`: Prefect's flow, one `dvc repro` a
    stage, MLflow) in a clone-like workspace, once a session: the workspace and the command's
    output. Tests that only read a finished run read it; tests that change one take
    copy_workspace of it (a run of every stage costs ~100 s of CPU)."""
    root = tmp_path_factory.mktemp("small-run")
    ws = root / "ws"
    env = dvc_workspace(ws, SMALL) | {"PREFECT_HOME": str(root / "prefect")}
    done = subprocess.run([sys.executable, "-m", "pipelines", str(ws)], cwd=ws, env=env, capture_output=True,
                          text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return ws, done.stdout + done.stderr


@pytest.fixture
def project_copy(small_project, tmp_path) -> Path:
    """A private copy of the small project, for tests that change or break things."""
    dst = tmp_path / "project"
    shutil.copytree(small_project, dst)
    return dst


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def prefect_server(tmp_path) -> dict:
    """A real Prefect server on a free port of 127.0.0.1 (its own home): the environment that reaches it."""
    port = free_port()
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_API_URL": f"http://127.0.0.1:{port}/api"}
    env.pop("PREFECT_API_KEY", None)
    proc = subprocess.Popen(["prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=2)
            break
        except OSError:
            time.sleep(1)
    else:
        proc.kill()
        pytest.fail("the Prefect server did not start in 120 s")
    yield {k: v for k, v in env.items() if k.startswith("PREFECT")}
    proc.terminate()
    proc.wait(timeout=30)
