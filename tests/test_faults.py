"""Bad input and faults against the real stages (issue 19's catalogue), each held to one
contract: the documented exit code (2), a one-line message naming the file, key or value, no
traceback, nothing the stage had written before changed, and an answer within seconds. Then:
what a killed run leaves behind is cleared by the next one, and never another live run's work."""

from __future__ import annotations

import hashlib
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import SMALL, stage_process, write_params
from longctx.config import merge
from longctx.io import atomic_dir, clear_stale


@dataclass(frozen=True)
class Case:
    stage: str
    params: dict
    """Overrides of the small project's params (SMALL)."""
    message: str
    """A regular expression the error line matches."""
    setup: Callable[[Path], None] | None = None
    """Breaks something in the project before the stage runs."""
    env: dict[str, str] = field(default_factory=dict)


def _write(name: str, text: str) -> Callable[[Path], None]:
    return lambda project: (project / name).write_text(text)


CASES = {
    "typo_key": Case("pack", {"pack": {"seeed": 1}}, r"pack\.seeed: unknown key"),
    "shares_099": Case("pack", {"pack": {"groups": {"shortmix": {"docstrings": 0.59}}}},
                       r"pack\.groups\.shortmix: shares sum to 0\.99, must sum to 1"),
    "shares_12": Case("pack", {"pack": {"groups": {"shortmix": {"docstrings": 0.8}}}},
                      r"pack\.groups\.shortmix: shares sum to 1\.2, must sum to 1"),
    "negative_length": Case("pack", {"pack": {"splits": {"stage1": {"seq_len": -512}}}},
                            r"pack\.splits\.stage1\.seq_len: .*greater than 0"),
    "zero_length": Case("pack", {"pack": {"splits": {"stage1": {"seq_len": 0}}}},
                        r"pack\.splits\.stage1\.seq_len: .*greater than 0"),
    "string_length": Case("pack", {"pack": {"splits": {"stage1": {"seq_len": "long"}}}},
                          r"pack\.splits\.stage1\.seq_len: .*integer"),
    "rope_target_in_window": Case("rope_search", {"rope_search": {"target_length": 256, "original_window": 256}},
                                  r"rope_search\.target_length: 256 must exceed the original window 256"),
    "unknown_backend": Case("base", {"model": {"attention_backend": "flashy"}},
                            r"model\.attention_backend: attention backend 'flashy' is unknown"),
    "backend_not_on_this_machine": Case("base", {"model": {"attention_backend": "cudnn"}},
                                        r"model\.attention_backend: attention backend 'cudnn' cannot run on cpu"),
    "odd_head_dim_with_rope": Case("base", {"model": {"d_model": 36, "n_heads": 4}},
                                   r"model: RoPE needs an even head_dim"),
    "head_dim_the_backend_refuses": Case("base", {"model": {"attention_backend": "fox", "d_model": 48}},
                                         r"attention backend 'fox' takes a power-of-two head_dim .*heads have 12"),
    "sequence_parallel_over_ranks": Case("base", {"train": {"base": {"sequence_parallel": 2}}},
                                         r"train\.base\.sequence_parallel: 2 does not divide the world size 1"),
    "sequence_parallel_over_heads": Case("base", {"train": {"nproc": 3, "base": {"sequence_parallel": 3}}},
                                         r"train\.base\.sequence_parallel: 3 does not divide the model's 4 "
                                         r"attention heads"),
    "mlflow_unreachable": Case("pack", {}, r"tracking\.uri: the MLflow server at http://127\.0\.0\.1:9 does not "
                               r"answer \(.*refused\).*tracking\.unreachable: local",
                               env={"MLFLOW_TRACKING_URI": "http://127.0.0.1:9"}),
    "unknown_profile": Case("pack", {"profile": "huge"}, r"profile: unknown profile 'huge'"),
    "invalid_yaml": Case("pack", {}, r"params\.yaml:3:10: not valid YAML: mapping values are not allowed here",
                         setup=_write("params.yaml", "profile: tiny\npack:\n  seed: a: b\n")),
}


def test_an_unreachable_tracking_server_can_fall_back_to_the_local_store(project_copy):
    from mlflow.tracking import MlflowClient

    local = f"sqlite:///{(project_copy / 'mlflow.db').resolve()}"

    def pack_runs() -> int:
        client = MlflowClient(local)
        runs = client.search_runs([client.get_experiment_by_name("longctx").experiment_id])
        return sum(r.info.run_name == "pack" for r in runs)

    before = pack_runs()
    params = merge(SMALL, {"tracking": {"unreachable": "local"}})
    done = stage_process(project_copy, "pack", params, {"MLFLOW_TRACKING_URI": "http://127.0.0.1:9"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "tracking: http://127.0.0.1:9 does not answer" in done.stderr and f"recording in {local}" in done.stderr
    assert pack_runs() == before + 1


def _tree(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _run_case(project: Path, case: Case) -> subprocess.CompletedProcess:
    write_params(project, merge(SMALL, case.params))
    if case.setup is not None:
        case.setup(project)
    return stage_process(project, case.stage, None, case.env)


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_fails_fast_with_one_clear_line_and_changes_nothing(name, project_copy):
    case = CASES[name]
    before = _tree(project_copy / "data")
    start = time.perf_counter()
    done = _run_case(project_copy, case)
    seconds = time.perf_counter() - start
    assert done.returncode == 2, done.stdout[-1500:] + done.stderr[-1500:]
    errors = [line for line in done.stderr.splitlines() if line.startswith(f"{case.stage}: error: ")]
    assert len(errors) == 1 and re.search(case.message, errors[0]), done.stderr[-1500:]
    assert "Traceback" not in done.stdout + done.stderr
    assert _tree(project_copy / "data") == before
    assert not (project_copy / "models").exists() and not (project_copy / "runs").exists()
    assert seconds < 30


def _dead_pid() -> int:
    """The pid of a process that has exited."""
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)


def test_a_killed_runs_temporaries_go_and_a_live_runs_stay(tmp_path):
    host, dead = socket.gethostname(), _dead_pid()
    stale = tmp_path / f".packed.tmp-{host}-{dead}-k3j2"
    stale.mkdir()
    (stale / "tokens.bin").write_bytes(b"\0" * 1024)
    old = tmp_path / f".packed.old-{host}-{dead}"
    old.mkdir()
    kept = [tmp_path / f".packed.tmp-{host}-{os.getpid()}-live",  # a run still writing
            tmp_path / f".packed.tmp-otherhost-{dead}-x9",  # another host's, on a shared disk
            tmp_path / f".tokens.tmp-{host}-{dead}-a1",  # another output's
            tmp_path / "packed-notes"]
    for path in kept:
        path.mkdir()
    with atomic_dir(tmp_path / "packed") as tmp:
        (tmp / "index.json").write_text("{}")
    assert not stale.exists() and not old.exists()
    assert all(path.exists() for path in kept)
    assert (tmp_path / "packed/index.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*(p.name for p in kept), "packed"])
    # without a name, every output's stale temporaries go (a checkpoint folder at a run's start)
    assert clear_stale(tmp_path) == [tmp_path / f".tokens.tmp-{host}-{dead}-a1"]
