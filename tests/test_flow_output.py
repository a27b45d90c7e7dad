"""What the pipeline flow shows of a stage's output (no Prefect server needed): DVC's per-stage
hints, lock-file notes and skipped upstream stages and progress bars' running states are
dropped, a bar's final state shown once, and a machine without GPUs waits on no concurrency
slot."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess

import pytest

from conftest import GIT_ENV
from longctx.errors import LongctxError
from longctx.eval import report
from pipelines import flows

# what `dvc repro pack` and a training stage print (DVC 3.67's hint; tqdm's bars through a pipe)
OUTPUT = """Stage 'corpora' didn't change, skipping
Stage 'tokenize' didn't change, skipping
Running stage 'pack':
> python -m stages.pack
corpora books: 0doc [00:00, ?doc/s]\rcorpora books: 21doc [00:01, 18.64doc/s]
corpora books: 116doc [00:02, 61.20doc/s]
pack stage1/train:   0%|          | 0/594 [00:00<?, ?seq/s]\rpack stage1/train:  50%|#####     | 297/594 [00:01<00:01]
pack stage1/train: 100%|##########| 594/594 [00:02<00:00, 290seq/s]
pack stage1/train: 100%|##########| 594/594 [00:02<00:00, 290seq/s]

split  seq_len  sequences
stage1    2048        594
train: 100%|##########| 4/4 [00:01<00:00, 3.2step/s, loss=6.1]
base: val loss 6.0
train: 100%|##########| 4/4 [00:01<00:00, 3.1step/s, loss=5.9]
Generating lock file 'dvc.lock'
Updating lock file 'dvc.lock'

To track the changes with git, run:

\tgit add dvc.lock

To enable auto staging, run:

\tdvc config core.autostage true
Use `dvc push` to send your updates to remote storage.
"""


def test_the_flow_log_keeps_what_a_person_reads():
    console = flows.Console("pack")
    shown = [line for raw in OUTPUT.splitlines() if (line := console.shown(raw)) is not None]
    assert shown == [
        "Running stage 'pack':", "> python -m stages.pack",
        "pack stage1/train: 100%|##########| 594/594 [00:02<00:00, 290seq/s]",
        "split  seq_len  sequences", "stage1    2048        594",
        "train: 100%|##########| 4/4 [00:01<00:00, 3.2step/s, loss=6.1]", "base: val loss 6.0",
        "train: 100%|##########| 4/4 [00:01<00:00, 3.1step/s, loss=5.9]"]  # another bar of the same name


def test_the_stage_run_still_says_it_was_skipped():
    console = flows.Console("pack")
    assert console.shown("Stage 'pack' didn't change, skipping\n") == "Stage 'pack' didn't change, skipping"
    assert console.shown("Stage 'packing' didn't change, skipping\n") is None


def test_one_git_hint_when_dvc_lock_changed(tmp_path_factory):
    repo, bare = tmp_path_factory.mktemp("repo"), tmp_path_factory.mktemp("bare")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True, env={**os.environ, **GIT_ENV})
    assert flows.git_hint(repo) is None
    (repo / "dvc.lock").write_text("schema: '2.0'\n")
    assert "git add dvc.lock" in flows.git_hint(repo)
    (bare / "dvc.lock").write_text("schema: '2.0'\n")
    assert flows.git_hint(bare) is None  # not a git repository: nothing to say


def test_no_gpu_slot_is_waited_for_without_gpus(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the GPU concurrency limit was asked for on a machine without GPUs")

    monkeypatch.setattr(flows, "concurrency", refuse)
    monkeypatch.delenv("LONGCTX_GPUS", raising=False)
    with flows.gpu_slot("base") as extra:
        assert extra == {}
    monkeypatch.setenv("LONGCTX_GPUS", "0")
    with pytest.raises(AssertionError, match="concurrency limit"), flows.gpu_slot("base"):
        pass


def test_a_gpu_slot_counts_among_the_visible_gpus(monkeypatch, tmp_path):
    """LONGCTX_GPUS=1 under CUDA_VISIBLE_DEVICES=2,3 is the fourth GPU (its lock too), as CUDA counts;
    without CUDA_VISIBLE_DEVICES it is GPU 1; past the visible ones it is an error naming both."""
    monkeypatch.setattr(flows, "concurrency", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setenv("LONGCTX_GPU_LOCKS", str(tmp_path))
    monkeypatch.setenv("LONGCTX_GPUS", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    with flows.gpu_slot("base") as extra:
        assert extra == {"CUDA_VISIBLE_DEVICES": "3"}
    assert [p.name for p in tmp_path.iterdir()] == ["gpu3.lock"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with flows.gpu_slot("sft") as extra:
        assert extra == {"CUDA_VISIBLE_DEVICES": "1"}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    with pytest.raises(LongctxError, match="LONGCTX_GPUS names GPU 1, but CUDA_VISIBLE_DEVICES=5 shows 1"):
        with flows.gpu_slot("base"):
            pass
    with flows.gpu_slot("pack") as extra:  # a CPU stage takes no slot
        assert extra == {}


def _eval_json(folder, prompts: dict, formats: list[str] | None = None) -> None:
    """metrics/eval.json as the eval stage writes it from prompt rows: checkpoint -> (task,
    length) -> each prompt's score; with the synthetic formats trained on, its `formats` section."""
    rows = [{"checkpoint": c, "task": t, "length": n, "score": s} for c, cells in prompts.items()
            for (t, n), scores in cells.items() for s in scores]
    ev = {"tasks": {c: report.mean_scores([r for r in rows if r["checkpoint"] == c]) for c in prompts},
          "cells": {c: report.cells([r for r in rows if r["checkpoint"] == c]) for c in prompts},
          "means": {c: report.length_cells([r for r in rows if r["checkpoint"] == c]) for c in prompts},
          "verdicts": report.verdicts(rows, list(prompts)), "best": report.best(rows, list(prompts)),
          "ppl_by_length": {"base": {"512": 20.0, "2048": 90.0}, "pretrain_stage2": {"512": 19.0, "2048": 25.0}},
          "needle_ppl": {"base": {"2048": 40.0}}, "retention_ppl": {"base": 21.5},
          "position_loss": {c: {"documents": 3, "bands": {"0-512": 3.1, "512-2048": 2.5 + 0.5 * (c == "base")}}
                            for c in prompts},
          "windows": {"base": 512, "pretrain_stage2": 8192}}
    if formats is not None:
        ev["formats"] = report.format_groups(rows, list(prompts), formats)
    (folder / "metrics").mkdir(exist_ok=True)
    (folder / "metrics/eval.json").write_text(json.dumps(ev))


def test_the_final_table_shows_every_task_at_every_length_and_names_the_best(tmp_path):
    from longctx.eval.summary import summary

    base = {("passkey", 512): [1.0] * 10, ("kv", 512): [1.0] * 5 + [0.0] * 5,
            ("passkey", 2048): [0.0] * 10, ("kv", 2048): [0.0] * 10}
    longer = {**base, ("passkey", 2048): [1.0] * 9 + [0.0], ("kv", 2048): [1.0] * 3 + [0.0] * 7}
    _eval_json(tmp_path, {"base": base, "pretrain_stage2": longer})
    lines = summary(tmp_path).splitlines()
    assert [line.split() for line in lines] == [
        ["base", "pretrain_stage2"],
        ["at", "512", "tokens", "(n", "=", "10", "prompts", "a", "task;", "95%", "intervals)"],
        ["kv", "0.50", "[0.24-0.76]", "0.50", "[0.24-0.76]"], ["passkey", "1.00", "[0.72-1.00]", "1.00", "[0.72-1.00]"],
        ["mean", "0.75", "[0.53-0.89]", "0.75", "[0.53-0.89]"], ["vs", "base", "no", "diff.", "0-0"],
        ["at", "2048", "tokens", "(n", "=", "10", "prompts", "a", "task;", "95%", "intervals)"],
        ["kv", "0.00", "[0.00-0.28]*", "0.30", "[0.11-0.60]"],
        ["passkey", "0.00", "[0.00-0.28]*", "0.90", "[0.60-0.98]"],
        ["mean", "0.00", "[0.00-0.16]*", "0.60", "[0.39-0.78]"], ["vs", "base", "better", "12-0"],
        ["perplexity"], ["at", "2048", "tokens", "90.0", "25.0"], ["needle", "at", "2048", "tokens", "40.0", "n/a"],
        ["short", "context", "21.5", "n/a"],
        ["loss", "by", "position", "(mean", "over", "3", "long", "documents)"],
        ["tokens", "0-512", "3.100", "3.100"], ["tokens", "512-2048", "3.000", "2.500"],
        ["*", "beyond", "the", "checkpoint's", "window", "(the", "length", "it", "was", "trained", "to)"],
        ["best", "at", "2048", "tokens:", "pretrain_stage2", "(mean", "task", "score", "0.60;", "better",
         "than", "every", "other", "checkpoint", "on", "the", "same", "prompts", "at", "95%)"]]
    # a lead too small for its prompts: named as the highest, not as the best
    _eval_json(tmp_path, {"base": base, "pretrain_stage2": {**base, ("kv", 2048): [1.0] * 2 + [0.0] * 8}})
    assert summary(tmp_path).splitlines()[-1] == (
        "at 2048 tokens no checkpoint is best at 95%: pretrain_stage2 scores highest (0.10) but is "
        "not better than base on the same prompts")
    _eval_json(tmp_path, {"base": base, "pretrain_stage2": base})
    last = summary(tmp_path).splitlines()[-1]
    assert last == ("at 2048 tokens every checkpoint scores 0.00, alike on every prompt: the tasks do not tell "
                    "them apart")


def test_the_final_table_reports_held_out_formats_apart(tmp_path):
    from longctx.eval.summary import summary

    base = {("passkey", 512): [0.0] * 10, ("common_words", 512): [0.5] * 10}
    longer = {("passkey", 512): [1.0] * 10, ("common_words", 512): [0.5] * 8 + [0.0] * 2}
    _eval_json(tmp_path, {"base": base, "pretrain_stage2": longer}, formats=["passkey"])
    rows = [line.split() for line in summary(tmp_path).splitlines()[2:8]]
    assert rows == [["passkey", "0.00", "[0.00-0.28]", "1.00", "[0.72-1.00]"],
                    ["common_words", "(held-out)", "0.50", "[0.50-0.50]", "0.40", "[0.25-0.50]"],
                    ["mean,", "trained", "formats", "0.00", "[0.00-0.28]", "1.00", "[0.72-1.00]"],
                    ["mean,", "held-out", "formats", "0.50", "[0.50-0.50]", "0.40", "[0.25-0.50]"],
                    ["mean,", "all", "tasks", "0.25", "[0.18-0.32]", "0.70", "[0.61-0.79]"],
                    ["vs", "base", "better", "10-2"]]
    ev = json.loads((tmp_path / "metrics/eval.json").read_text())
    table = report.comparison({**report.empty_results(), **ev}).splitlines()
    at = table.index("| checkpoint | formats | @512 |")
    assert table[at + 2:at + 6] == [
        "| base | trained formats | 0.00 [0.00-0.28] (10) |",
        "| pretrain_stage2 | trained formats | 1.00 [0.72-1.00] (10), better (10-0) |",
        "| base | held-out formats | 0.50 [0.50-0.50] (10) |",
        "| pretrain_stage2 | held-out formats | 0.40 [0.25-0.50] (10), no difference (0-2) |"]
    # with kv's documents trained instead, every task is held out of passkey's format too
    _eval_json(tmp_path, {"base": base, "pretrain_stage2": longer}, formats=[])
    assert "passkey (held-out)" in summary(tmp_path)


def test_the_parent_run_gets_the_headline_results():
    ev = {"tasks": {"base": {"passkey": {"512": 1.0, "2048": 0.0}, "kv": {"512": 0.5, "2048": 0.0}}},
          "ppl_by_length": {"base": {"512": 20.0, "2048": 90.0}}}
    assert flows.headline(ev) == {"results/base.tasks_at_512": 0.75, "results/base.tasks_at_2048": 0.0,
                                  "results/base.ppl_at_512": 20.0, "results/base.ppl_at_2048": 90.0}
    assert flows.headline(None) == {} and flows.headline({"skipped": True}) == {}
    ev["means"] = {"base": {"512": {"mean": 0.75, "n": 20, "lo": 0.57, "hi": 0.88}}}
    assert {k: v for k, v in flows.headline(ev).items() if "512" in k and "tasks" in k} == {
        "results/base.tasks_at_512": 0.75, "results/base.tasks_at_512.n": 20, "results/base.tasks_at_512.lo": 0.57,
        "results/base.tasks_at_512.hi": 0.88}


def test_the_closing_lines_serve_the_store_and_open_the_runs_table(tmp_path):
    """The command pastes where the path has spaces; the address opens the experiment's runs in the
    model-training view (MLflow 3.17 opens its GenAI overview otherwise); a server's address as is."""
    from longctx.config import TrackingParams
    from longctx.tracking.store import experiment_id
    from pipelines.__main__ import open_runs

    ws = tmp_path / "my runs" / "ws"
    ws.mkdir(parents=True)
    command, page = open_runs(ws, TrackingParams())
    assert shlex.split(command.removeprefix("open the runs:")) == ["mlflow", "ui", "--backend-store-uri",
                                                                  f"sqlite:///{ws}/mlflow.db"]
    exp = experiment_id(TrackingParams(), ws)
    assert page.split() == ["then:", f"http://127.0.0.1:5000/#/experiments/{exp}/runs?workflowType=machine_learning"]
    assert open_runs(ws, TrackingParams(enabled=False)) == ["MLflow tracking is off (params tracking.enabled)"]
