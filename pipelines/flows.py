"""Prefect flows over the DVC pipeline.

`longctx-pipeline` runs one Prefect task per DVC stage (`dvc repro <stage>`, so DVC decides what
is stale) in dependency order, streams each stage's output into the Prefect logs, opens one MLflow
parent run named after the flow run (every stage's run is its child, tagged with its dvc.lock
hash), and publishes a Markdown artifact of the stages' metrics. GPU stages take a slot of the
`longctx-gpu` global concurrency limit and a GPU (CUDA_VISIBLE_DEVICES) from LONGCTX_GPUS.
A workspace lock refuses a second pipeline run on the same workspace while one is running.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import yaml
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.concurrency.sync import concurrency
from prefect.exceptions import ObjectNotFound
from prefect.runtime import flow_run

from longctx.config import load
from longctx.errors import LongctxError
from longctx.eval import compare
from longctx.eval.plots import family_figure
from longctx.eval.report import interval_text, length_means, score_rows, verdict_text
from longctx.eval.summary import summary
from longctx.eval.tasks import family
from longctx.io import PIPELINE_ENV, pipeline_lock
from longctx.tracking.runs import end_run, open_run, tag_children
from longctx.tracking.store import tracking_uri
from longctx.tracking.tracker import PARENT_ENV


def stages_of(workspace: Path) -> list[str]:
    """The DVC stages in the order dvc.yaml lists them (the order they depend on each other)."""
    return list(yaml.safe_load((workspace / "dvc.yaml").read_text())["stages"])


STAGES = stages_of(Path(__file__).resolve().parents[1])
GPU_STAGES = {"base", "rope_search", "pretrain", "sft", "eval"}
GPU_LIMIT = "longctx-gpu"


class StageFailed(RuntimeError):
    """A stage exited non-zero; the message is its own error output and how to rerun."""


class _StageFailedWithoutTraceback(logging.Filter):
    """Prefect logs the exception that ends a flow with its traceback; a StageFailed's message
    is already the stage's own error, and the traceback through Prefect's engine adds nothing."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], StageFailed):
            record.exc_info = record.exc_text = None
        return True


for _name in ("prefect.flow_runs", "prefect.task_runs"):
    logging.getLogger(_name).addFilter(_StageFailedWithoutTraceback())

RERUN = ("fix that, then rerun the pipeline (the stages that finished are kept and skipped) or this stage "
         "alone: dvc repro {}")


@contextmanager
def workspace_lock(workspace: Path):
    """One pipeline run per workspace at a time: a second one is refused, not queued; a stage run
    by hand meanwhile (`dvc repro eval`) is refused by the stage (io.pipeline_holder)."""
    with pipeline_lock(workspace, f"flow run {flow_run.get_name() or '?'} (pid {os.getpid()})"):
        yield


def gpu_ids() -> list[str]:
    return [g for g in os.environ.get("LONGCTX_GPUS", "").split(",") if g]


def physical_gpu(gpu: str) -> str:
    """The device a stage gets for LONGCTX_GPUS entry `gpu`: under CUDA_VISIBLE_DEVICES an index
    counts among the visible devices, as CUDA's own ordinals do (the slot sets the stage's
    CUDA_VISIBLE_DEVICES, which would otherwise point past the user's choice)."""
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v]
    if not visible or not gpu.isdigit():
        return gpu
    if int(gpu) >= len(visible):
        raise LongctxError(f"LONGCTX_GPUS names GPU {gpu}, but CUDA_VISIBLE_DEVICES={','.join(visible)} shows "
                           f"{len(visible)}: give indices among the visible GPUs")
    return visible[int(gpu)]


def ensure_gpu_limit() -> str | None:
    """The `longctx-gpu` global concurrency limit, one slot per GPU of LONGCTX_GPUS, created when
    the server has none (an ephemeral server never does), so that GPU stages of concurrent flows
    on this server queue for it; a limit the user made is kept. Returns what was done, for the log."""
    gpus = gpu_ids()
    if not gpus:
        return None
    for g in gpus:  # (before any stage: a GPU CUDA_VISIBLE_DEVICES hides is an error now, not at the first GPU stage)
        physical_gpu(g)
    with get_client(sync_client=True) as client:
        try:
            have = client.read_global_concurrency_limit_by_name(GPU_LIMIT)
            return f"GPU stages take slots of the concurrency limit {GPU_LIMIT!r} ({have.limit} slots)"
        except ObjectNotFound:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=GPU_LIMIT, limit=len(gpus)))
            return (f"created the concurrency limit {GPU_LIMIT!r}: {len(gpus)} slot(s), one per GPU of "
                    f"LONGCTX_GPUS={','.join(gpus)}")


@contextmanager
def gpu_slot(stage: str):
    """A GPU for a GPU stage: a slot of the global limit (when the server has one) and one of
    LONGCTX_GPUS (comma-separated ids) by a per-GPU file lock; nothing for CPU stages, nor where
    LONGCTX_GPUS names no GPU (a machine without GPUs has no slot to wait for)."""
    gpus = gpu_ids()
    if stage not in GPU_STAGES or not gpus:
        yield {}
        return
    gpus = [physical_gpu(g) for g in gpus]
    with concurrency(GPU_LIMIT, occupy=1, strict=False):
        lock_dir = Path(os.environ.get("LONGCTX_GPU_LOCKS", "/tmp/longctx-gpu-locks"))
        lock_dir.mkdir(parents=True, exist_ok=True)
        while True:
            for g in gpus:
                fh = (lock_dir / f"gpu{g}.lock").open("a")
                try:
                    fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    fh.close()
                    continue
                try:
                    yield {"CUDA_VISIBLE_DEVICES": g}
                finally:
                    fcntl.flock(fh, fcntl.LOCK_UN)
                    fh.close()
                return
            import time

            time.sleep(5)


def lock_hash(workspace: Path, stage: str) -> str | None:
    lock = workspace / "dvc.lock"
    if not lock.is_file():
        return None
    entry = (yaml.safe_load(lock.read_text()) or {}).get("stages", {}).get(stage)
    return hashlib.md5(json.dumps(entry, sort_keys=True).encode()).hexdigest() if entry else None


@task(retries=1, retry_delay_seconds=10, retry_condition_fn=lambda task, run, state: _transient(state))
def run_stage(workspace: str, stage: str, parent_run: str | None, tracking_uri: str) -> dict:
    """`dvc repro <stage>` with its output streamed into the Prefect log; the stage's metrics."""
    log = get_run_logger()
    ws = Path(workspace)
    with gpu_slot(stage) as extra:
        env = {**os.environ, **extra, "MLFLOW_TRACKING_URI": tracking_uri, "DVC_NO_ANALYTICS": "1", PIPELINE_ENV: "1"}
        if parent_run:
            env[PARENT_ENV] = parent_run
        # (DVC's lock is free between the flow's stages: a `dvc repro` by hand may hold it while its stage
        # refuses to run beside this one; the flow's next stage waits for it, not fails)
        proc = subprocess.Popen(["dvc", "--wait-for-lock", "repro", stage], cwd=ws, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1)
        tail: list[str] = []
        console = Console(stage)
        try:
            for raw in proc.stdout:
                if (line := console.shown(raw)) is not None:
                    log.info("%s | %s", stage, line)
                    tail = (tail + [line])[-40:]
        except KeyboardInterrupt:  # Ctrl-C reached the stage too: let it finish saying what it kept
            _drain(proc, stage)
            raise
        code = proc.wait()
    if code != 0:
        errors = [t for t in tail if "error" in t.lower()] or tail[-10:]
        raise StageFailed(f"stage {stage} failed (exit {code}):\n" + "\n".join(errors) + "\n" + RERUN.format(stage))
    metrics = ws / "metrics" / f"{stage}.json"
    return json.loads(metrics.read_text()) if metrics.is_file() else {}


def _drain(proc: subprocess.Popen, stage: str, grace: float = 60.0) -> None:
    """Print what an interrupted stage still says (its last line: what it kept) until it exits;
    kill it after `grace` seconds."""
    timer = threading.Timer(grace, proc.kill)
    timer.start()
    try:
        for raw in proc.stdout:
            if raw.strip():
                print(f"{stage} | {raw.rstrip()}", file=sys.stderr)
        proc.wait()
    finally:
        timer.cancel()


class Console:
    """What of a stage's output the flow logs: every line but blank ones, progress bars' running
    states (a bar's final state once: tqdm prints it again right after, when it closes; bars
    without a total have no final state and show nothing), DVC's per-stage git and remote hints
    and lock-file notes (the flow gives one hint at its end), and DVC's word on the upstream
    stages it skips (`stage`, the one run, still says so when it is skipped)."""

    HINTS = ("To track the changes with git", "git add ", "To enable auto staging", "dvc config core.autostage",
             "Use `dvc push`", "Updating lock file", "Generating lock file")
    COUNTER = re.compile(r"^.*: \d+\w* \[\d+:\d+(:\d+)?, [^]]*\]$")
    """A tqdm bar without a total: 'corpora books: 21doc [00:01, 18.64doc/s]'."""

    def __init__(self, stage: str | None = None):
        self.bar: str | None = None
        self.skip = re.compile(r"^Stage '(?!{}')[^']+' didn't change, skipping$".format(re.escape(stage or "")))

    def shown(self, raw: str) -> str | None:
        line = raw.rstrip("\n").split("\r")[-1]
        quiet = line.strip()
        if not quiet or quiet.startswith(self.HINTS) or self.skip.match(quiet) or self.COUNTER.match(quiet):
            return None
        bar = line.split("100%|")[0] if "100%|" in line else None
        if ("%|" in line and bar is None) or (bar is not None and bar == self.bar):
            return None
        self.bar = bar  # the bar just shown (a repeat follows it at once), or None
        return line


def git_hint(ws: Path) -> str | None:
    """One line for the whole run where DVC would print one per stage: dvc.lock changed."""
    out = subprocess.run(["git", "status", "--porcelain", "--", "dvc.lock"], cwd=ws, capture_output=True, text=True)
    if out.returncode or not out.stdout.strip():
        return None
    return "dvc.lock changed: `git add dvc.lock` records this run in git (`dvc config core.autostage true` does it)"


def _transient(state) -> bool:
    """Retry infrastructure hiccups, never a stage that failed on its own terms."""
    try:
        state.result()
    except StageFailed:
        return False
    except Exception:
        return True
    return False


def headline(evaluated: dict | None) -> dict[str, float]:
    """The parent run's metrics, section `results`: each checkpoint's mean task score (with the
    prompts behind it and its 95% interval: `.n`, `.lo`, `.hi`) and perplexity at each length
    (from this run's eval, when it ran)."""
    if not evaluated or "tasks" not in evaluated:
        return {}
    _, means = length_means(evaluated["tasks"])
    out = {f"results/{c}.tasks_at_{n}": v for c, by in means.items() for n, v in by.items()}
    out |= {f"results/{c}.tasks_at_{n}.{k}": cell[k] for c, by in evaluated.get("means", {}).items()
            for n, cell in by.items() for k in ("n", "lo", "hi")}
    out |= {f"results/{c}.ppl_at_{n}": v for c, by in evaluated.get("ppl_by_length", {}).items()
            for n, v in by.items()}
    return out


def comparison_view(evaluated: dict | None) -> dict:
    """The parent run's one place to compare checkpoints: every checkpoint x task x length score
    as an MLflow table, and the scores by task family against length as one figure."""
    if not evaluated or not evaluated.get("tasks"):
        return {}
    rows = score_rows(evaluated["tasks"], evaluated.get("cells"))
    table = {key: [r.get(key) for r in rows] for key in ("checkpoint", "task", "length", "score", "n", "lo", "hi")}
    table["family"] = [family(r["task"]) for r in rows]
    windows = evaluated.get("windows", {})
    return {"tables": {"results/scores.json": table},
            "figures": {"results/score_by_family.png": lambda: family_figure(evaluated["tasks"], windows)}}


def _summary(results: dict[str, dict]) -> str:
    lines = ["| stage | key metrics |", "|---|---|"]
    for stage, metrics in results.items():
        flat = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        if not flat and "summary" in metrics:
            flat = {k: v for k, v in metrics["summary"].items() if isinstance(v, (int, float))}
        shown = ", ".join(f"{k}={v:.4g}" for k, v in list(flat.items())[:6]) or "(this stage writes no metrics)"
        lines.append(f"| {stage} | {shown} |")
    return "\n".join(lines)


@flow(name="longctx-pipeline", log_prints=True)
def pipeline(workspace: str = ".", stages: list[str] | None = None) -> dict[str, dict]:
    """Run the DVC stages in order (all by default); a failed stage fails the flow with its error.
    MLflow store and experiment are the workspace params' `tracking` settings, as for the stages."""
    ws = Path(workspace).resolve()
    chosen = [s for s in stages_of(ws) if stages is None or s in stages]
    params = load(ws / "params.yaml")
    tracking = params.tracking
    uri = tracking_uri(tracking, ws)
    with workspace_lock(ws):
        if done := ensure_gpu_limit():
            get_run_logger().info(done)
        parent = open_run(tracking, ws, "pipeline", flow_run.get_name() or "pipeline",
                          {"prefect.flow_run_id": str(flow_run.get_id() or ""), "longctx.profile": params.profile})
        results = {}
        try:
            for stage in chosen:
                tags = ["gpu"] if stage in GPU_STAGES else ["cpu"]
                results[stage] = run_stage.with_options(tags=tags, task_run_name=f"dvc repro {stage}")(
                    str(ws), stage, parent, uri)
                if digest := lock_hash(ws, stage):
                    tag_children(tracking, ws, parent, stage, {"dvc.lock_md5": digest})
            if hint := git_hint(ws):
                get_run_logger().info(hint)
        finally:
            evaluated = results.get("eval")
            note = f"```\n{summary(ws)}\n```" if evaluated and (ws / "metrics" / "eval.json").is_file() else None
            end_run(tracking, ws, parent, ok=len(results) == len(chosen), metrics=headline(evaluated),
                    description=note, **comparison_view(evaluated))
            create_markdown_artifact(_summary(results), key="longctx-stages",
                                     description=f"stage metrics of {ws}")
    return results


@task
def queue_and_run(workspace: str, grid: dict[str, list], jobs: int, tracking_uri: str) -> list[dict]:
    """Queue one `dvc exp run -S ...` per grid point, run the queue, return each experiment's
    name, params and metrics (from `dvc exp show --json`)."""
    import itertools

    log = get_run_logger()
    ws = Path(workspace)
    env = {**os.environ, "MLFLOW_TRACKING_URI": tracking_uri, "DVC_NO_ANALYTICS": "1"}
    keys = list(grid)
    for values in itertools.product(*(grid[k] for k in keys)):
        sets = [a for k, v in zip(keys, values, strict=True) for a in ("-S", f"{_added(k)}={json.dumps(v)}")]
        out = subprocess.run(["dvc", "exp", "run", "--queue", *sets], cwd=ws, env=env, capture_output=True, text=True)
        if out.returncode:
            raise StageFailed(f"dvc exp run --queue {' '.join(sets)} failed:\n{out.stderr[-2000:]}")
        log.info("queued %s", " ".join(sets))
    done = subprocess.run(["dvc", "exp", "run", "--run-all", "-j", str(jobs)], cwd=ws, env=env,
                          capture_output=True, text=True)
    for line in (done.stdout + done.stderr).splitlines()[-50:]:
        log.info("sweep | %s", line)
    if done.returncode:
        raise StageFailed(f"dvc exp run --run-all failed:\n{done.stderr[-3000:]}")
    shown = json.loads(subprocess.run(["dvc", "exp", "show", "--json"], cwd=ws, env=env, capture_output=True,
                                      text=True, check=True).stdout)
    return _experiments(shown)


def _added(key: str) -> str:
    """DVC's override for a key params.yaml may not list (it holds empty sections): `++key`."""
    return key if key.startswith(("+", "~")) else f"++{key}"


def _experiments(shown: list[dict]) -> list[dict]:
    """Name, params and metrics of every experiment in `dvc exp show --json` output."""
    out = []
    for commit in shown:
        for exp in commit.get("experiments") or []:
            for rev in exp.get("revs") or []:
                data = rev.get("data") or {}
                params = (data.get("params") or {}).get("params.yaml", {}).get("data", {})
                metrics = {f: m.get("data", {}) for f, m in (data.get("metrics") or {}).items()}
                out.append({"name": rev.get("name") or exp.get("name"), "rev": rev.get("rev"), "params": params,
                            "metrics": metrics})
    return out


@flow(name="longctx-sweep", log_prints=True)
def sweep(workspace: str = ".", grid: dict[str, list] | None = None, jobs: int = 1) -> list[dict]:
    """Queue and run DVC experiments over a param grid (e.g. RoPE method x long/short ratio);
    publish a comparison table (Prefect artifact; MLflow runs carry each experiment's name)."""
    ws = Path(workspace).resolve()
    grid = grid or {"train.pretrain.factors": [None, "search"]}
    tracking = load(ws / "params.yaml").tracking
    with workspace_lock(ws):
        exps = queue_and_run(str(ws), grid, jobs, tracking_uri(tracking, ws))
    table, paired = _sweep_table(ws, grid, exps)
    create_markdown_artifact(table, key="longctx-sweep", description=f"experiments of {ws}")
    # the comparison as a run of its own (the experiments' runs carry dvc.experiment tags)
    run = open_run(tracking, ws, "sweep", f"sweep {flow_run.get_name() or ''}".strip())
    end_run(tracking, ws, run, ok=True, text={"sweep_comparison.md": table + "\n\n" + paired})
    return exps


def _sweep_table(ws: Path, grid: dict[str, list], exps: list[dict]) -> tuple[str, str]:
    """The sweep's table (an experiment a row: its grid values, mean eval score, last validation
    loss, and its last checkpoint paired against the same checkpoint of the committed run, HEAD,
    on the same prompts) and every checkpoint's paired table beneath it."""
    keys = list(grid)
    base, why = None, ""
    try:
        base = compare.prompt_rows(ws, "HEAD")
    except LongctxError as e:  # HEAD holds no eval run: nothing to pair against
        why = str(e)
    lines = ["| experiment | " + " | ".join(keys) + " | mean task score [95%] (prompts), last checkpoint at the "
             "longest length | pretrain val loss | vs HEAD on the same prompts |", "|---" * (len(keys) + 4) + "|"]
    details = []
    for e in exps:
        values = [str(_lookup(e["params"], k)) for k in keys]
        means = _eval_results(ws, e.get("rev")).get("means") or {}
        score = "n/a"
        if means:
            last, by = list(means.items())[-1]
            longest = max(by, key=int)
            score = f"{last} @{longest}: {interval_text(by[longest]['mean'], by[longest])}"
        losses = e["metrics"].get("metrics.json", {}).get("val_loss", {})  # (the headline's)
        val = [v for c, v in losses.items() if c.startswith("pretrain_")]
        versus = "n/a (HEAD has no eval run)" if base is None else "n/a (no eval run)"
        if base is not None and e.get("rev"):
            paired = compare.paired_runs(compare.prompt_rows(ws, e["rev"]), base)
            if paired:
                last = list(paired)[-1]
                versus = f"{last}: " + ", ".join(f"{verdict_text(v)} @{n}" for n, v in paired[last]["all"].items())
                details.append(compare.table(paired, e["name"], "HEAD"))
        lines.append(f"| {e['name']} | " + " | ".join(values) +
                     f" | {score} | {val[-1] if val else 'n/a'} | {versus} |")
    return "\n".join(lines), "\n".join(details) if base is not None else f"not paired: {why}"


def _eval_results(ws: Path, rev: str | None) -> dict:
    """An experiment's metrics/eval.json (a DVC output, not a metric: `dvc exp show` shows the
    headline, metrics.json, alone), or {} where it has none."""
    import dvc.api
    from dvc.exceptions import DvcException

    try:
        return json.loads(dvc.api.read("metrics/eval.json", repo=str(ws), rev=rev)) if rev else {}
    except (FileNotFoundError, DvcException):  # a revision or file that is not there
        return {}


def _lookup(tree: dict, dotted: str):
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


if __name__ == "__main__":
    pipeline(sys.argv[1] if len(sys.argv) > 1 else ".")
