"""The real DVC pipeline in a temp git repo: the main command's run of every stage (one `dvc
repro` each, under Prefect) leaves what each stage makes and MLflow's record of it, a change to
one stage's params reruns that stage alone, and a forced rerun leaves the next stages up to date."""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import REPO, copy_workspace, sh
from pipelines.flows import STAGES

pytestmark = pytest.mark.slow  # end to end through real DVC, Prefect and MLflow: `pytest -m "not slow"` skips it


@pytest.fixture(scope="module")
def finished(small_run, tmp_path_factory) -> tuple[Path, dict, str]:
    """A copy of the session's finished run of every stage (and its output), which the tests here
    change in turn: each leaves it as every stage up to date, so each also runs alone."""
    ws = tmp_path_factory.mktemp("dvc") / "ws"
    env = copy_workspace(small_run[0], ws)
    assert (ws / ".dvc/config").is_file()  # a clone is a DVC repo as it is
    return ws, env, small_run[1]


def test_every_stage_runs_through_dvc_and_is_tracked(finished):
    ws, env, out = finished
    for stage in STAGES:
        assert f"Running stage '{stage}'" in out
    for ckpt in ("base", "pretrain_stage1", "pretrain_stage2", "sft"):  # each checkpoint's scores as they come
        assert re.search(rf"eval {ckpt}: mean task score \d\.\d\d \[\d\.\d\d-\d\.\d\d\] at 256 \(n = \d+\), "
                         r"\d\.\d\d \[\d\.\d\d-\d\.\d\d\] at 512 \(n = \d+\)", out), ckpt
        spent = re.search(rf"eval {ckpt}: ([\d.]+) s \(([\d.]+) the tasks at [\d.]+ prompts/s, [\d.-]+ perp", out)
        assert spent and 0 < float(spent[2]) <= float(spent[1]), ckpt  # where each checkpoint's time went
    # the stage's start, phase by phase, and its whole time, the phases adding up to it
    ready = re.search(r"eval: ready in ([\d.]+) s \(imports ([\d.]+), data [\d.]+, MLflow run [\d.]+, first ", out)
    assert ready and 0 < float(ready[2]) <= float(ready[1])
    whole = re.search(r"eval: ([\d.]+) s \((.*)\)\n", out)
    assert whole and abs(sum(float(p.rsplit(" ", 1)[1]) for p in whole[2].split(", ")) - float(whole[1])) < 0.5
    assert (ws / "data/packed/stage1/train/tokens.bin").stat().st_size > 0
    assert json.loads((ws / "metrics/pack.json").read_text())["stage1.train"]["sequences"] > 0
    assert (ws / "plots/length_hist.png").stat().st_size > 10_000

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{ws / 'mlflow.db'}")
    exp = client.get_experiment_by_name("longctx")
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"  # the UI opens its runs, not GenAI
    (parent,) = client.search_runs([exp.experiment_id], filter_string="tags.`longctx.stage` = 'pipeline'")
    runs = {r.info.run_name: r for r in client.search_runs([exp.experiment_id]) if r.info.run_id != parent.info.run_id}
    curriculum = {"stage1 (pretrain)", "stage2 (pretrain)"}  # nested in pretrain's run, each its own curve
    assert set(runs) == set(STAGES) | curriculum
    assert len({name[:12] for name in runs}) == len(runs)  # told apart where MLflow's runs table cuts names
    assert parent.info.status == "FINISHED"  # the flow run's parent: every stage's run is its child
    assert all(runs[s].data.tags["mlflow.parentRunId"] == parent.info.run_id for s in STAGES)
    assert runs["sft"].data.tags["dvc.lock_md5"] and runs["sft"].data.tags["git.commit"]
    for name in curriculum:
        assert runs[name].data.tags["mlflow.parentRunId"] == runs["pretrain"].info.run_id
        split = name.split()[0]
        assert runs[name].data.tags["longctx.curriculum"] == split
        assert {f"train_{split}.png", f"{split}.csv"} <= {a.path for a in client.list_artifacts(runs[name].info.run_id)}
        history = client.get_metric_history(runs[name].info.run_id, "train/loss")
        assert [m.step for m in history] == list(range(1, len(history) + 1))
        assert runs[name].data.metrics["train/final.val_loss"] > 0
    final = runs["stage2 (pretrain)"].data.metrics["train/final.val_loss"]
    # pretrain's run shows each curriculum stage's loss figure too
    shown = {a.path for a in client.list_artifacts(runs["pretrain"].info.run_id)}
    assert {"train_stage1.png", "train_stage2.png"} <= shown
    assert runs["pretrain"].data.metrics["train/stage2.val_loss"] == final
    assert not client.get_metric_history(runs["pretrain"].info.run_id, "train/loss")  # no zig-zag of two curves
    assert all(r.info.status == "FINISHED" for r in runs.values())
    # one key, one quantity: every stage's keys under its section (the training stages share `train`)
    section = dict.fromkeys(("base", "pretrain", "sft", *curriculum), "train")
    for name, r in runs.items():
        assert r.data.metrics and all(k.startswith(f"{section.get(name, name)}/") for k in r.data.metrics), name
    assert runs["pack"].data.params["pack.seed"] == "0"
    assert runs["pack"].data.metrics["pack/tokens_per_s"] > 0
    assert runs["tokenize"].data.metrics["tokenize/code_repos.kept_docs"] > 0
    assert runs["corpora"].data.tags["git.commit"]
    artifacts = {a.path for a in client.list_artifacts(runs["tokenize"].info.run_id)}
    assert {"length_hist.png", "length_table.txt"} <= artifacts
    # the training chain: base -> pretrain (two curriculum stages, base change) -> sft
    assert len(client.get_metric_history(runs["base"].info.run_id, "train/loss")) == 4
    pretrain = json.loads((ws / "metrics/pretrain.json").read_text())
    assert set(pretrain) == {"stage1", "stage2"} and all(v["val_loss"] > 0 for v in pretrain.values())
    stage2 = json.loads((ws / "models/pretrain/stage2/longctx_config.json").read_text())["model"]
    assert stage2["rope"]["theta"] == 2560000.0 and stage2["max_position_embeddings"] == 2048
    hf = json.loads((ws / "models/sft/hf/config.json").read_text())
    assert hf["rope_theta"] == 2560000.0 and (ws / "models/sft/hf/tokenizer.json").is_file()
    assert json.loads((ws / "metrics/sft.json").read_text())["steps"] == 2
    # rope_search: every method on the same sequences, at the original window and the target
    search = json.loads((ws / "metrics/rope_search.json").read_text())
    methods = {"original", "pi", "ntk", "yarn", "base_change", "longrope2"}
    assert {(r["method"], r["length"]) for r in search["table"]} == {(m, n) for m in methods for n in (256, 512)}
    assert search["summary"]["critical_index_theory"] == 2 and search["summary"]["generations"] == 2  # head 8, 256
    factors = json.loads((ws / "models/rope_search/factors.json").read_text())
    assert factors["rope_type"] == "longrope" and len(factors["long_factor"]) == 4
    settings = json.loads((ws / "models/rope_search/methods.json").read_text())  # each method's whole setting
    assert set(settings["factors"]) == set(settings["attention_factor"]) == methods
    assert settings["attention_factor"]["pi"] == 1.0 and settings["attention_factor"]["yarn"] > 1.0
    assert {"searched_equals", "searched_factors_equal"} <= set(search["summary"])
    assert not search["summary"]["baselines_in_space"]["pi"]["in_space"]  # below r the space is NTK-shaped
    assert min(factors["long_factor"][search["summary"]["critical_index_searched"]:]) >= 2.0  # >= s
    assert len(client.get_metric_history(runs["rope_search"].info.run_id, "rope_search/search.best_needle_nll")) == 3
    assert {"rope_factors.png", "table.csv"} <= {a.path for a in client.list_artifacts(runs["rope_search"].info.run_id)}
    # eval: every checkpoint, the same prompts at every length, also past a checkpoint's window (marked)
    ev = json.loads((ws / "metrics/eval.json").read_text())
    ckpts = {"base", "pretrain_stage1", "pretrain_stage2", "sft"}
    assert set(ev["tasks"]) == ckpts and len(ev["tasks"]["sft"]) == 11
    assert set(ev["tasks"]["base"]["niah_single_noise"]) == {"256", "512"} and ev["windows"]["base"] == 256
    assert not [s for s in ev["skipped"] if "window" in s.get("reason", "")]
    score = r"[0-9.]+ \[[0-9.]+-[0-9.]+\] \(\d+\)"  # mean [95% interval] (prompts)
    assert re.search(rf"\| base \| {score} \| {score}\* \|", (ws / "reports/eval/comparison.md").read_text())
    assert any(s["task"] == "helmet:nq" and "cannot load" in s["reason"] for s in ev["skipped"] if "task" in s)
    assert all(0 <= v <= 1 for by in ev["tasks"].values() for t in by.values() for v in t.values())
    assert set(ev["retention_ppl"]) == ckpts and all(v > 1 for v in ev["retention_ppl"].values())
    assert ev["ppl_by_length"]["pretrain_stage2"]["2048"] > 1 and ev["throughput"]["sft"]["prompts_per_s"] > 0
    assert (ws / "plots/eval/niah_heatmap.png").stat().st_size > 5000
    prompts = (ws / "reports/eval/prompts.jsonl").read_text().splitlines()
    assert len(prompts) == 11 * 2 * 4
    assert "| sft |" in (ws / "reports/eval/comparison.md").read_text()
    assert runs["eval"].data.metrics["eval/sft.prompts_per_s"] > 0
    assert set(ev["position_loss"]["sft"]["bands"]) == {"0-256", "256-512", "512-2048"}  # on the code documents
    assert runs["eval"].data.metrics["eval/sft.loss_at_512-2048"] == pytest.approx(
        ev["position_loss"]["sft"]["bands"]["512-2048"])
    assert {"comparison.md", "score_by_family.png"} <= {a.path for a in client.list_artifacts(runs["eval"].info.run_id)}
    # dvc.yaml's one metrics file, `dvc exp show`'s first columns: each checkpoint's mean task score at
    # each length (the parent run's results/ metrics) and its validation loss, in training order
    head = json.loads((ws / "metrics.json").read_text())
    order = ["base", "pretrain_stage1", "pretrain_stage2", "sft"]
    assert list(head) == [f"{c}@{n}" for c in order for n in (256, 512)] + ["val_loss"]
    for c in order:
        for n in (256, 512):
            assert head[f"{c}@{n}"] == pytest.approx(parent.data.metrics[f"results/{c}.tasks_at_{n}"])
    assert list(head["val_loss"]) == order
    assert head["val_loss"]["sft"] == json.loads((ws / "metrics/sft.json").read_text())["val_loss"]
    # the tasks in no training document's format, reported apart
    held = ev["formats"]["tasks"]["held_out"]
    assert set(held) == {"json_kv", "variable_tracking", "common_words", "frequent_words", "icl"}
    held_mean = ev["formats"]["means"]["held_out"]["sft"]["512"]["mean"]
    assert runs["eval"].data.metrics["eval/sft.held_out.512.mean"] == held_mean
    assert "| sft | held-out formats |" in (ws / "reports/eval/comparison.md").read_text()
    # each training stage's loss curve as a figure beside its CSV
    assert {"train_base.csv", "train_base.png"} <= {a.path for a in client.list_artifacts(runs["base"].info.run_id)}
    assert "train_sft.png" in {a.path for a in client.list_artifacts(runs["sft"].info.run_id)}


def dvc_stdout(args: list[str], cwd: Path, env: dict) -> str:
    """What `dvc <args>` prints on stdout (its warnings, on stderr, left out)."""
    proc = subprocess.run(["dvc", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"dvc {args} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def readme_command(prefix: str) -> list[str]:
    """The README's command line that starts with `prefix`, as argv: its first command (up to
    `&&`), its comment dropped."""
    line = next(x for x in (REPO / "README.md").read_text().splitlines() if x.startswith(prefix))
    argv = shlex.split(line, comments=True)
    return argv[:argv.index("&&")] if "&&" in argv else argv


def test_the_readme_experiment_takes_the_searched_factors(finished):
    """README's `dvc exp run -S ...` as written: the searched factors reach pretraining, the new
    stage-1 mix reaches pack (every stage after it reads data/packed), the data before it stays;
    the stages' MLflow runs go under one named after the experiment, and `dvc exp show` puts the
    headline first (with the README's flags: it and the changed params alone)."""
    ws, env, _ = finished
    sh(["git", "add", "-A"], ws, env)
    sh(["git", "commit", "-qm", "finished run"], ws, env)
    out = sh(readme_command("dvc exp run -S ++train.pretrain.factors=search"), ws, env)
    ran = set(re.findall(r"Running stage '(\w+)'", out))
    assert "pretrain" in ran and "pack" in ran and not {"corpora", "tokenize"} & ran, ran
    params = yaml.safe_load((ws / "params.yaml").read_text())  # the experiment, applied to the workspace
    assert params["pack"]["splits"]["stage1"]["mix"] == {"books": 0.24, "code_repos": 0.1}
    searched = json.loads((ws / "models/rope_search/factors.json").read_text())
    rope = json.loads((ws / "models/pretrain/stage2/longctx_config.json").read_text())["model"]["rope"]
    assert rope["type"] == "longrope" and rope["long_factor"] == searched["long_factor"]
    assert rope["original_max_position_embeddings"] == 256
    hf = json.loads((ws / "models/sft/hf/config.json").read_text())
    assert (hf.get("rope_scaling") or hf.get("rope_parameters"))["long_factor"] == searched["long_factor"]
    # its stages' MLflow runs under one run named after the experiment, as the main command's under the flow run's
    from mlflow.tracking import MlflowClient

    name = re.search(r"Ran experiment\(s\): (\S+)", out)[1]
    client = MlflowClient(tracking_uri=f"sqlite:///{ws / 'mlflow.db'}")
    store = client.get_experiment_by_name("longctx").experiment_id
    (parent,) = client.search_runs([store], filter_string=f"tags.`dvc.experiment` = '{name}' and "
                                   "tags.`longctx.stage` = 'experiment'")
    assert parent.info.run_name == name and parent.info.status == "FINISHED"
    assert "mlflow.parentRunId" not in parent.data.tags  # the top-level run (each stage's was, before)
    children = client.search_runs([store], filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert {r.info.run_name for r in children} == ran
    # `dvc exp show`: dvc.yaml's one metrics file, its columns first (every stage's metrics made 1,568 columns
    # here); with the README's flags, the headline's columns and the params that changed, no deps
    order = ["base", "pretrain_stage1", "pretrain_stage2", "sft"]
    headline = [f"{c}@{n}" for c in order for n in (256, 512)] + [f"val_loss.{c}" for c in order]
    shown = json.loads(dvc_stdout(["exp", "show", "--json"], ws, env))
    assert {f for row in shown for f in (row["data"].get("metrics") or {})} == {"metrics.json"}
    columns = dvc_stdout(["exp", "show", "--csv"], ws, env).splitlines()[0].split(",")
    assert columns[:5] == ["Experiment", "rev", "typ", "Created", "parent"] and columns[5:17] == headline
    assert len(columns) <= 5 + len(headline) + 61 + 30  # SMALL's 58 params and the 3 set here, 30 deps
    changed = {"train.pretrain.factors", "pack.splits.stage1.mix.books", "pack.splits.stage1.mix.code_repos"}
    # (the README's flags: the columns that differ between the rows, no deps' hashes, which DVC names by path)
    readme_flags = readme_command("dvc exp show")[3:]
    assert readme_flags and "--csv" not in readme_flags, readme_flags
    header = dvc_stdout(["exp", "show", *readme_flags, "--csv"], ws, env).splitlines()[0].split(",")
    assert changed <= set(header) and set(header) - changed <= {*headline, "Experiment", "rev", "typ", "Created",
                                                                 "parent"}, header
    sh(["git", "checkout", "params.yaml"], ws, env)
    sh(["dvc", "repro"], ws, env)  # back to the base change (from DVC's run cache)
    # the README's and params.yaml's other examples: DVC takes their overrides (queued, not run)
    sh(readme_command("dvc exp run --queue -S profile="), ws, env)
    example = next(x for x in (REPO / "params.yaml").read_text().splitlines() if "dvc exp run -S ++" in x)
    sh([*shlex.split(example.lstrip("# ")), "--queue"], ws, env)
    assert sh(["dvc", "queue", "status"], ws, env).count("Queued") == 2
    sh(["dvc", "queue", "remove", "--all"], ws, env)


def test_a_pack_param_reruns_pack_alone(finished):
    """A stage's param reruns that stage and those after it, nothing before: a training param
    (sft, then eval on its checkpoint), and a pack param (pack, not the corpora or tokenizer)."""
    ws, env, _ = finished
    sh(["git", "add", "-A"], ws, env)
    sh(["git", "commit", "-qm", "lock", "--allow-empty"], ws, env)  # (nothing new after the experiment test)
    assert "up to date" in sh(["dvc", "status"], ws, env)
    params = yaml.safe_load((ws / "params.yaml").read_text())
    params["train"]["sft"]["lr"] = 2e-3
    (ws / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    out = sh(["dvc", "repro"], ws, env)
    assert "Running stage 'sft'" in out and "Running stage 'eval'" in out
    assert not any(f"Running stage '{s}'" in out for s in ("corpora", "tokenize", "pack", "base", "pretrain"))
    params["pack"]["seed"] = 3
    (ws / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    status = json.loads(sh(["dvc", "status", "--json"], ws, env).strip().splitlines()[-1])
    assert set(status) == {"pack"}
    out = sh(["dvc", "repro", "pack"], ws, env)  # (the stages after it would rerun as sft did)
    assert "Running stage 'pack'" in out
    assert "Running stage 'corpora'" not in out and "Running stage 'tokenize'" not in out
    sh(["git", "checkout", "params.yaml"], ws, env)
    out = sh(["dvc", "repro"], ws, env)  # back to the committed params: outputs from DVC's run cache
    assert "Running stage" not in out and "up to date" in sh(["dvc", "status"], ws, env)


def test_rerunning_a_stage_leaves_the_next_ones_up_to_date(finished):
    """A forced rerun writes the same bytes (no timings in DVC outputs; training resumes its
    finished run), so no later stage becomes stale."""
    ws, env, _ = finished
    sh(["dvc", "repro"], ws, env)
    for stage in ("corpora", "tokenize", "pack", "base", "rope_search", "pretrain", "sft"):
        before = digests(ws / "models")
        out = sh(["dvc", "repro", "-f", "--single-item", stage], ws, env)
        status = sh(["dvc", "status"], ws, env)
        after = digests(ws / "models")
        changed = sorted(f for f in before.keys() | after.keys() if before.get(f) != after.get(f))
        assert "up to date" in status, (stage, status, changed, out[-3000:])


def digests(folder: Path) -> dict[str, str]:
    """Each file's md5 (which of a stage's files a rerun changed, when one did)."""
    return {str(f.relative_to(folder)): hashlib.md5(f.read_bytes()).hexdigest()
            for f in sorted(folder.rglob("*")) if f.is_file()}
