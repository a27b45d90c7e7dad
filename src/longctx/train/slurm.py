"""A training stage as a Slurm batch job (issue 64): the stage command, run where DVC or the Prefect
flow runs it (a login node), writes an sbatch script from params, submits it, streams the job's log
to its own output (so into `dvc repro`'s and the flow's logs) and exits with the job's exit code;
stopped (Ctrl-C, SIGTERM: a cancelled flow run), it cancels the job first. In the job, `srun` starts
the same stage command once on each node, which starts torchrun with the c10d rendezvous on the
allocation's head node (launch.py). The workspace must be on a filesystem every node sees."""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from pathlib import Path

from ..config import TrainParams
from ..errors import ConfigError, DataError
from . import launch

COMMANDS = ("sbatch", "squeue", "scancel", "scontrol")
RUNS = Path("runs") / "slurm"
"""Each job's script, log and exit code, under the workspace."""


def per_node(train: TrainParams) -> tuple[int, int]:
    """(GPUs, processes) on each node of the job: train.slurm.gpus_per_node, else train.nproc."""
    return launch.per_node(train, train.slurm.gpus_per_node, "train.slurm.gpus_per_node")


def script(stage: str, params: str, train: TrainParams, workspace: Path, log: Path, rc: Path) -> str:
    """The sbatch script: the allocation (train.nodes nodes, the GPUs, time, partition, account, any
    more options) and the stage under srun, one task a node; its exit code written to `rc`."""
    s = train.slurm
    gpus, _ = per_node(train)
    lines = ["#!/bin/bash", f"#SBATCH --job-name=longctx-{stage}", f"#SBATCH --nodes={train.nodes}",
             "#SBATCH --ntasks-per-node=1", f"#SBATCH --time={s.time}", f"#SBATCH --chdir={workspace}",
             f"#SBATCH --output={log}", "#SBATCH --open-mode=append"]
    if gpus:
        lines.append(f"#SBATCH --gpus-per-node={gpus}")
    if s.cpus_per_node:
        lines.append(f"#SBATCH --cpus-per-task={s.cpus_per_node}")
    lines += [f"#SBATCH --partition={s.partition}"] * bool(s.partition)
    lines += [f"#SBATCH --account={s.account}"] * bool(s.account)
    lines += [f"#SBATCH {opt}" for opt in s.options]
    lines += ["", *s.setup]
    cmd = [sys.executable if s.python is None else s.python, "-m", f"stages.{stage}", "--params", params]
    lines += ["srun --kill-on-bad-exit=1 " + shlex.join(cmd), f"echo $? > {shlex.quote(str(rc))}", ""]
    return "\n".join(lines)


def _slurm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=120)


def check_commands() -> None:
    import shutil

    missing = [c for c in COMMANDS if shutil.which(c) is None]
    if missing:
        raise ConfigError(f"train.slurm.enabled: {', '.join(missing)} not on PATH: run the stage where Slurm's "
                          "commands are (a login node), or set train.slurm.enabled: false")


def run(stage: str, params: str, train: TrainParams, workspace: Path) -> int:
    """Submit the stage, stream its log until the job ends, return its exit code."""
    check_commands()
    folder = workspace / RUNS
    folder.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path, log, rc = (folder / f"{stage}-{stamp}{ext}" for ext in (".sbatch", ".log", ".rc"))
    path.write_text(script(stage, params, train, workspace, log, rc))
    done = _slurm("sbatch", "--parsable", str(path))
    if done.returncode != 0:
        raise DataError(f"sbatch {path}: {done.stderr.strip() or done.stdout.strip()}")
    job = done.stdout.strip().split(";")[0]
    gpus, processes = per_node(train)
    print(f"{stage}: Slurm job {job}, {train.nodes} node(s) x {processes} processes ({gpus} GPUs a node); log {log}",
          file=sys.stderr, flush=True)
    shown = 0
    try:
        while True:
            state = _state(job)
            shown = _show(log, shown)
            if state is None or state in ENDED:
                break
            time.sleep(train.slurm.poll_seconds)
    except KeyboardInterrupt:
        _cancel(job, log, shown, stage)
        raise
    _show(log, shown)
    if rc.is_file() and rc.read_text().strip().isdigit():
        return int(rc.read_text())
    print(f"{stage}: Slurm job {job} ended {state or 'out of the queue'} without the stage's exit code "
          f"(cancelled, out of time, or a node failed): see {log}", file=sys.stderr)
    return 1


ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
         "DEADLINE"}


def _state(job: str) -> str | None:
    """The job's state (None once Slurm has forgotten it)."""
    out = _slurm("scontrol", "show", "job", "-o", job)
    for field in out.stdout.split():
        if field.startswith("JobState="):
            return field.split("=", 1)[1]
    return None


def _show(log: Path, shown: int) -> int:
    """Print what the job's log gained since `shown` bytes; the new offset."""
    if not log.is_file():
        return shown
    with log.open("rb") as fh:
        fh.seek(shown)
        new = fh.read()
    if new:
        sys.stdout.write(new.decode(errors="replace"))
        sys.stdout.flush()
    return shown + len(new)


def _cancel(job: str, log: Path, shown: int, stage: str, grace: float = 60.0) -> None:
    """scancel the job and wait (up to `grace` s) for it to leave, its last lines shown."""
    _slurm("scancel", job)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and (state := _state(job)) is not None and state not in ENDED:
        time.sleep(1)
    _show(log, shown)
    print(f"{stage}: cancelled Slurm job {job}", file=sys.stderr, flush=True)
