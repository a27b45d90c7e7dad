"""Training stages as Slurm batch jobs (train/slurm.py, issue 64 item 3). The script is checked as text;
then a real Slurm (Debian's slurm-wlm: slurmctld and two slurmd, nodes n1 and n2 on this machine, munge
on a private socket) runs the tiny base stage through sbatch and srun on its 2 nodes, and a stage
stopped while its job runs cancels the job. Skipped where Slurm's daemons are not installed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import SMALL, copy_workspace, sh, stage_env, stage_process, write_params
from longctx import config
from longctx.errors import ConfigError
from longctx.train import slurm

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "sinfo")


def test_the_script_asks_for_the_nodes_and_gpus_and_runs_the_stage_under_srun(tmp_path):
    train = config.resolve({"profile": "tiny", "train": {"nodes": 4, "nproc": 8, "slurm": {
        "enabled": True, "partition": "gpu", "account": "lab", "time": "2-00:00:00", "options": ["--qos=high"],
        "setup": ["source .venv/bin/activate"], "python": "python3"}}}).train
    text = slurm.script("pretrain", "params.yaml", train, tmp_path, tmp_path / "j.log", tmp_path / "j.rc")
    lines = text.splitlines()
    for want in ["#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --time=2-00:00:00", "#SBATCH --partition=gpu", "#SBATCH --account=lab",
                 "#SBATCH --qos=high", f"#SBATCH --chdir={tmp_path}", f"#SBATCH --output={tmp_path / 'j.log'}",
                 "source .venv/bin/activate",
                 "srun --kill-on-bad-exit=1 python3 -m stages.pretrain --params params.yaml",
                 f"echo $? > {tmp_path / 'j.rc'}"]:
        assert want in lines, (want, text)
    assert lines.index("source .venv/bin/activate") < lines.index(next(x for x in lines if x.startswith("srun")))
    cpu = train.model_copy(update={"slurm": train.slurm.model_copy(update={"gpus_per_node": 0})})
    assert "gpus-per-node" not in slurm.script("base", "p.yaml", cpu, tmp_path, tmp_path / "l", tmp_path / "r")
    assert slurm.per_node(cpu) == (0, 8)
    auto = train.model_copy(update={"nproc": "auto"})
    with pytest.raises(ConfigError, match="train.slurm.gpus_per_node"):
        slurm.per_node(auto)
    with pytest.raises(ConfigError, match="train.slurm.options"):
        config.resolve({"profile": "tiny", "train": {"slurm": {"options": ["qos=high"]}}})
    with pytest.raises(ConfigError, match="train.slurm.time"):
        config.resolve({"profile": "tiny", "train": {"slurm": {"time": "two days"}}})


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """slurmctld and slurmd n1, n2 on this machine; SLURM_CONF names its slurm.conf."""
    if missing := [d for d in DAEMONS if shutil.which(d) is None and not Path(f"/usr/sbin/{d}").exists()]:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)} missing: apt-get install slurmctld slurmd "
                    "slurm-client munge)")
    root = tmp_path_factory.mktemp("slurm")
    for sub in ("munge", "state", "log", "spool/n1", "spool/n2"):
        (root / sub).mkdir(parents=True)
    (root / "munge").chmod(0o700)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    ctld, p1, p2 = _free_ports(3)
    conf = root / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=longctx-test", "SlurmctldHost=localhost", f"SlurmctldPort={ctld}", "SlurmUser=root",
        "SlurmdUser=root", "AuthType=auth/munge", f"AuthInfo=socket={root}/munge/sock", "CredType=cred/munge",
        f"StateSaveLocation={root}/state", f"SlurmdSpoolDir={root}/spool/%n", f"SlurmctldPidFile={root}/ctld.pid",
        f"SlurmdPidFile={root}/slurmd-%n.pid", f"SlurmctldLogFile={root}/log/slurmctld.log",
        f"SlurmdLogFile={root}/log/slurmd-%n.log", "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none", "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
        "MpiDefault=none", "MailProg=/bin/true", "ReturnToService=2", "MinJobAge=60",
        f"NodeName=n1 NodeAddr=127.0.0.1 Port={p1} CPUs=2 Sockets=1 CoresPerSocket=2 ThreadsPerCore=1",
        f"NodeName=n2 NodeAddr=127.0.0.1 Port={p2} CPUs=2 Sockets=1 CoresPerSocket=2 ThreadsPerCore=1",
        "PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP", ""]))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    munge = subprocess.run(["munged", "-f", f"--socket={root}/munge/sock", f"--key-file={key}",
                            f"--log-file={root}/munge/munged.log", f"--pid-file={root}/munge/munged.pid",
                            f"--seed-file={root}/munge/munged.seed"], capture_output=True, text=True)
    if munge.returncode != 0:
        pytest.skip(f"munged would not start: {munge.stderr.strip()}")
    daemons = [subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for cmd in (
        ["slurmctld", "-D", "-i", "-f", str(conf)], ["slurmd", "-D", "-N", "n1", "-f", str(conf)],
        ["slurmd", "-D", "-N", "n2", "-f", str(conf)])]
    try:
        deadline = time.monotonic() + 30
        while subprocess.run(["sinfo", "-h", "-o", "%t %D"], env=env, capture_output=True,
                             text=True).stdout.split() != ["idle", "2"]:
            if time.monotonic() > deadline or any(d.poll() is not None for d in daemons):
                pytest.skip(f"Slurm's nodes did not come up: {(root / 'log' / 'slurmctld.log').read_text()[-800:]}")
            time.sleep(0.2)
        yield env
    finally:
        for d in daemons:
            d.terminate()
        for d in daemons:
            try:
                d.wait(timeout=10)
            except subprocess.TimeoutExpired:
                d.kill()
        subprocess.run(["kill", (root / "munge" / "munged.pid").read_text().strip()], capture_output=True)


def _params(project: Path, **slurm_params) -> dict:
    base = {**SMALL["train"]["base"], "micro_batch": 1, "grad_accum": 2}
    train = {**SMALL["train"], "base": base, "nproc": 1, "nodes": 2,
             "slurm": {"enabled": True, "gpus_per_node": 0, "poll_seconds": 0.5, **slurm_params}}
    return {**SMALL, "tracking": {"enabled": False}, "train": train}


@pytest.mark.slow
def test_the_base_stage_trains_on_two_slurm_nodes_through_sbatch(cluster, project_copy):
    done = stage_process(project_copy, "base", _params(project_copy), env={"SLURM_CONF": cluster["SLURM_CONF"]})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "base: Slurm job " in done.stderr and "2 node(s) x 1 processes (0 GPUs a node)" in done.stderr
    # the job's log, streamed: srun ran the stage on n1 and n2, which met through the allocation's head
    assert "base: 1 processes on each of 2 nodes (Slurm, rendezvous 127.0.0.1:" in done.stdout, done.stdout[-3000:]
    [script] = (project_copy / slurm.RUNS).glob("base-*.sbatch")
    assert "#SBATCH --nodes=2" in script.read_text()
    assert script.with_suffix(".rc").read_text().strip() == "0"
    summary = json.loads((project_copy / "metrics" / "base.json").read_text())
    assert summary["train_loss"] > 0 and (project_copy / "models" / "base" / "model.safetensors").is_file()
    steps = [json.loads(line) for line in next(project_copy.glob("runs/base/*/metrics.jsonl")).read_text().splitlines()]
    assert len(steps) == SMALL["train"]["base"]["steps"]


@pytest.mark.slow
def test_a_stopped_stage_cancels_its_job_and_writes_nothing(cluster, project_copy):
    write_params(project_copy, _params(project_copy, setup=["sleep 60"]))   # the job waits before its stage
    proc = subprocess.Popen([sys.executable, "-m", "stages.base"], cwd=project_copy,
                            env={**stage_env(), "SLURM_CONF": cluster["SLURM_CONF"]},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not list((project_copy / slurm.RUNS).glob("base-*.log")) and time.monotonic() < deadline:
        time.sleep(0.2)   # the job started (its log opened)
    [log] = (project_copy / slurm.RUNS).glob("base-*.log")
    proc.send_signal(signal.SIGTERM)   # as a cancelled flow run, or a `kill`, stops the stage
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err[-2000:]
    job = err.split("base: Slurm job ")[1].split(",")[0]
    assert f"base: cancelled Slurm job {job}" in err
    state = subprocess.run(["scontrol", "show", "job", "-o", job], env=cluster, capture_output=True, text=True)
    assert "JobState=CANCELLED" in state.stdout, state.stdout + state.stderr
    assert not log.with_suffix(".rc").exists() and not (project_copy / "models" / "base").exists()


@pytest.mark.slow
def test_a_cancelled_flow_run_cancels_its_stages_slurm_job(cluster, small_run, tmp_path, prefect_server):
    """`prefect flow-run cancel` (the UI's Cancel) on a deployment's flow run while its base stage is a
    Slurm job: the job is cancelled, the flow run ends Cancelled, the base model from before is DVC's
    to restore (`dvc checkout base`: DVC clears a stage's outputs before it runs it) and nothing
    the job would have written is there."""
    ws = tmp_path / "ws"
    env = {**copy_workspace(small_run[0], ws, store=False), "LONGCTX_WORKSPACE": str(ws), **prefect_server,
           "SLURM_CONF": cluster["SLURM_CONF"]}
    kept = (ws / "models" / "base" / "model.safetensors").read_bytes()
    checkpoints = set(ws.glob("runs/base/*/checkpoints/step-*"))
    params = _params(ws, setup=["sleep 120"])   # (the job waits before its stage: cancelled while it runs)
    (ws / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    sh(["prefect", "work-pool", "create", "longctx-local", "--type", "process"], ws, env)
    sh(["prefect", "--no-prompt", "deploy", "--name", "tiny"], ws, env)
    worker = subprocess.Popen(["prefect", "worker", "start", "--pool", "longctx-local", "--prefetch-seconds", "1"],
                              cwd=ws, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        started = sh(["prefect", "deployment", "run", "longctx-pipeline/tiny"], ws, env)
        run_id = started.split("UUID:")[1].split()[0]
        job = _running_job(cluster, deadline=time.monotonic() + 300)
        sh(["prefect", "flow-run", "cancel", run_id], ws, env)
        deadline = time.monotonic() + 120
        while (state := _job_state(cluster, job)) != "CANCELLED" and time.monotonic() < deadline:
            time.sleep(0.5)
        assert state == "CANCELLED", state
        while "CANCELLED" not in (run := sh(["prefect", "flow-run", "inspect", run_id], ws, env)) \
                and time.monotonic() < deadline:
            time.sleep(1)
        assert "'type': 'CANCELLED'" in run or "StateType.CANCELLED" in run, run[-2000:]
    finally:
        worker.terminate()
        try:
            worker.wait(timeout=10)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
    assert not list((ws / slurm.RUNS).glob("base-*.rc"))
    assert set(ws.glob("runs/base/*/checkpoints/step-*")) == checkpoints
    sh(["dvc", "checkout", "base"], ws, env)
    assert (ws / "models" / "base" / "model.safetensors").read_bytes() == kept


def _running_job(cluster: dict, deadline: float) -> str:
    """The id of the first job the test cluster runs."""
    while time.monotonic() < deadline:
        out = subprocess.run(["squeue", "-h", "-t", "RUNNING", "-o", "%i"], env=cluster, capture_output=True, text=True)
        if jobs := out.stdout.split():
            return jobs[0]
        time.sleep(0.5)
    pytest.fail("no Slurm job started")


def _job_state(cluster: dict, job: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", "-o", job], env=cluster, capture_output=True, text=True).stdout
    return out.split("JobState=")[1].split()[0] if "JobState=" in out else "?"
