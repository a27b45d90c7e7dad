"""bench/rope_methods.py at a toy shape on the small project's data: a base trained at W, the search,
every method zero-shot and fine-tuned, scored at W, 4W and 8W; the JSON holds each method's whole
setting and scores, the targets are computed from the fine-tuned rows, and the figure is written."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

from conftest import REPO


def test_every_method_is_scored_zero_shot_and_fine_tuned(small_project, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    cmd = [sys.executable, "-m", "bench.rope_methods", "--tokens", str(small_project / "data/tokens"),
           "--long", str(small_project / "data/packed/stage2/val"), "--packed", str(small_project / "data/packed"),
           "--seeds", "0", "--base", "steps=8", "batch=4", "seq_len=128", "d_model=32", "n_layers=1", "n_heads=2",
           "ffn_dim=64", "--tune", "steps=3", "batch=2", "--search", "population=4", "generations=1",
           "sequences=1", "table_sequences=2", "--prompts", "1", "--out", str(tmp_path)]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    (path,) = tmp_path.glob("rope_methods-seed0-cpu-*.json")  # one seed: named by it, for --merge
    assert not list(tmp_path.glob("rope_methods-partial-*"))  # the per-method file gives way to the whole result
    out = json.loads(path.read_text())
    assert path.with_suffix(".png").stat().st_size > 10_000
    (r,) = out["results"]
    assert out["window"] == 128 and list(r["methods"]) == ["original", "pi", "ntk", "yarn", "base_change", "longrope2",
                                                          "longrope2_wide"]
    # the wide search's space reaches the last frequency (the paper's stops at the critical index)
    assert r["search_wide"]["candidates"][1] == 7 > r["search"]["candidates"][1]
    pi, yarn = r["methods"]["pi"], r["methods"]["yarn"]
    assert np.allclose(pi["factors"], 4.0) and yarn["attention_factor"] > 1.0  # each method's own setting at 4W
    for m in r["methods"].values():
        zero, tuned = m["zero_shot"], m["tuned"]
        for row in (zero, tuned):
            assert all(0 <= row[f"passkey_{n}"] <= 1 for n in (128, 512, 1024))
            assert np.isfinite(row["needle_ppl"]) and row["needle_ppl_interval"][0] <= row["needle_ppl_interval"][1]
            assert len(row["position_curve"]) == 64 and row["short_loss"] > 0
        assert tuned["short_loss"] != zero["short_loss"]  # the fine-tune moved the weights
    t = r["targets"]
    ours = r["methods"]["longrope2"]["tuned"]
    assert t["needle_ppl_4W"]["longrope2"] == ours["needle_ppl"]
    assert t["needle_ppl_4W"]["best_baseline"] == min(m["tuned"]["needle_ppl"] for k, m in r["methods"].items()
                                                      if k not in ("longrope2", "longrope2_wide"))
    assert t["needle_ppl_4W"]["met"] == (ours["needle_ppl"] <= t["needle_ppl_4W"]["best_baseline"])
    assert "targets:" in done.stdout and "longrope2" in done.stdout

    # seeds run side by side, one process each, then merged into one result
    other = out | {"results": [r | {"seed": 1}]}
    (tmp_path / "s1.json").write_text(json.dumps(other))
    merged_dir = tmp_path / "merged"
    merge = [sys.executable, "-m", "bench.rope_methods", "--merge", str(tmp_path / "s1.json"), str(path),
             "--out", str(merged_dir)]
    done = subprocess.run(merge, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    (joined,) = merged_dir.glob("rope_methods-cpu-*.json")
    both = json.loads(joined.read_text())
    assert [x["seed"] for x in both["results"]] == [0, 1] and both["window"] == 128
    assert joined.with_suffix(".png").stat().st_size > 10_000
    twice = subprocess.run(merge[:4] + [str(path), str(path), "--out", str(tmp_path / "x")], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=120)
    assert twice.returncode != 0 and "seed(s) [0]" in twice.stderr and not (tmp_path / "x").exists()
    (tmp_path / "w.json").write_text(json.dumps(other | {"window": 256}))
    differ = subprocess.run(merge[:4] + [str(path), str(tmp_path / "w.json"), "--out", str(tmp_path / "x")], cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=120)
    assert differ.returncode != 0 and "window" in differ.stderr
    six = {k: v for k, v in r["methods"].items() if k != "longrope2_wide"}
    old = out | {"results": [r | {"seed": 1, "methods": six}]}
    (tmp_path / "old.json").write_text(json.dumps(old))
    older = subprocess.run(merge[:4] + [str(path), str(tmp_path / "old.json"), "--out", str(tmp_path / "x")],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert older.returncode != 0 and "old.json: seed 1 lacks longrope2_wide" in older.stderr
    bad = subprocess.run(cmd[:5] + ["--search", "populaton=4"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode != 0 and "populaton" in bad.stderr
