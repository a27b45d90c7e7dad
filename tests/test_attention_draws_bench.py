"""bench/attention_draws.py on the CPU at the tiny shape: each draw's documents are the ones
bench/scale.py's step of that index trains on, FoX is timed per rank, and the estimated steps
swap exactly the measured step's attention for each draw's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO

SEQ, LAYERS = 4096, 2  # (the tiny shape has 2 layers)


def run(tmp_path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "bench/attention_draws.py", "--shape", "tiny", "--seq", str(SEQ),
                           "--sp", "2", "--draws", "3", "--out", str(tmp_path / "out"), *extra],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


def scale_json(tmp_path, name: str, rows: list[dict]) -> str:
    path = tmp_path / name
    path.write_text(json.dumps({"shape": "tiny", "world": 2, "rows": rows}))
    return str(path)


def row(model: str, step: float, first: float, seq: int = SEQ, **extra) -> dict:
    return {"model": model, "seq": seq, "sp": 2, "step_s": step, "first_step_s": first, "losses": [1.0, 1.0], **extra}


def test_draws_are_scales_steps_and_estimates_swap_attention(tmp_path):
    sys.path.insert(0, str(REPO / "bench"))
    from scale import documents

    steps = scale_json(tmp_path, "s.json", [row("Transformer", 10.0, 30.0), row("FoX (Pro)", 4.0, 20.0),
                                            row("FoX (Pro)", 99.0, 99.0, seq=2 * SEQ)])  # (another length: not read)
    done = run(tmp_path, "--steps", steps)
    assert done.returncode == 0, done.stderr[-3000:]
    res = json.loads((tmp_path / "out" / f"attention_draws-cpu-{SEQ}.json").read_text())
    rows = res["rows"]
    assert [r["seed"] for r in rows] == [0, 1000, 2000]
    for r in rows:
        bounds = documents(SEQ, r["seed"])
        lengths = (bounds[1:] - bounds[:-1]).double()
        assert r["documents"] == len(lengths) and r["density"] == pytest.approx(float((lengths**2).sum()) / SEQ**2,
                                                                                  abs=1e-4)
        assert len(r["fox_rank_seconds"]) == 2 and r["seconds"]["FoX (Pro)"] == max(r["fox_rank_seconds"])
        assert r["seconds"]["Transformer"] > 0
        assert r["peak_gib"] == {"Transformer": None, "FoX (Pro)": None}  # (measured on CUDA only)
    est = res["estimates"]
    for model, measured in (("Transformer", 10.0), ("FoX (Pro)", 4.0)):
        a = [r["seconds"][model] for r in rows]
        e = est[model]["estimated_step_s"]
        assert e[1] == pytest.approx(measured, abs=0.01)  # draw 1 is the one the millions rows timed
        for i in (0, 2):
            assert e[i] - e[1] == pytest.approx(LAYERS * (a[i] - a[1]), abs=0.02)
        beyond = est[model]["first_step_s"] - e[0]  # (each side rounded to 0.01 on its own: up to 0.01 apart)
        assert est[model]["first_step_beyond_estimate_s"] == pytest.approx(beyond, abs=0.011)
    total = [sum(est[m]["estimated_step_s"]) for m in ("Transformer", "FoX (Pro)")]
    assert est["ratio_over_draws"] == pytest.approx(total[0] / total[1], abs=2e-3)
    assert est["ratio_at_timed_draw"] == 2.5
    assert "over draws 0..2" in done.stdout


def test_rows_that_do_not_say_their_draws_and_unreadable_files_are_refused(tmp_path):
    vague = row("Transformer", 10.0, 30.0)
    vague["losses"] = [1.0, 1.0, 1.0]  # (a warm-up: which draw was timed is not known)
    done = run(tmp_path, "--steps", scale_json(tmp_path, "v.json", [vague]))
    assert done.returncode != 0 and "Transformer" in done.stderr and "draws" in done.stderr
    twice = run(tmp_path, "--steps", scale_json(tmp_path, "t.json", [row("FoX (Pro)", 1.0, 2.0)] * 2))
    assert twice.returncode != 0 and "more than one row of FoX (Pro)" in twice.stderr
    late = run(tmp_path, "--steps", scale_json(tmp_path, "l.json", [row("FoX (Pro)", 1.0, 2.0, timed_draws=[5])]))
    assert late.returncode != 0 and "--draws 3" in late.stderr
    missing = tmp_path / "nothing.json"
    done = run(tmp_path, "--steps", str(missing))
    assert done.returncode != 0 and str(missing) in done.stderr
    assert not (tmp_path / "out").exists()  # (nothing written by a refused run)


def test_each_backend_gets_the_measured_step_with_its_own_attention_swapped_in(tmp_path):
    """--backends times the Transformer on several backends; the measured step's attention is
    the backend it ran on (its row's `attention`, else --steps-attention), so that backend's
    estimate at the timed draw is the measured step and every other differs by its attention."""
    steps = scale_json(tmp_path, "s.json", [row("Transformer", 10.0, 30.0), row("FoX (Pro)", 4.0, 20.0)])
    done = run(tmp_path, "--steps", steps, "--backends", "sdpa", "reference", "--steps-attention", "reference")
    assert done.returncode == 0, done.stderr[-3000:]
    res = json.loads((tmp_path / "out" / f"attention_draws-cpu-{SEQ}.json").read_text())
    rows, est = res["rows"], res["estimates"]
    assert res["steps_attention"] == "reference" and set(est["ratios"]) == {"Transformer", "Transformer (reference)"}
    ran, other = est["Transformer (reference)"]["estimated_step_s"], est["Transformer"]["estimated_step_s"]
    assert ran[1] == pytest.approx(10.0, abs=0.01)
    for i, r in enumerate(rows):
        swap = LAYERS * (r["seconds"]["Transformer"] - r["seconds"]["Transformer (reference)"])
        assert other[i] - ran[i] == pytest.approx(swap, abs=0.02)
    e = est["Transformer"]
    assert e["tokens_per_s_per_gpu_over_draws"] == pytest.approx(SEQ // 2 * 3 / sum(other), rel=1e-3)
    assert "FoX (Pro)+ACP over Transformer (reference)" in done.stdout
    said = scale_json(tmp_path, "a.json", [row("Transformer", 10.0, 30.0, attention="flex")])
    refused = run(tmp_path, "--steps", said, "--backends", "sdpa")
    assert refused.returncode != 0 and "'flex'" in refused.stderr and "--backends" in refused.stderr


def test_only_times_the_draws_asked_for_the_steps_timed_ones_among_them(tmp_path):
    steps = scale_json(tmp_path, "s.json", [row("Transformer", 10.0, 30.0), row("FoX (Pro)", 4.0, 20.0)])
    refused = run(tmp_path, "--steps", steps, "--only", "0", "2")
    assert refused.returncode == 2 and "timed draws [1]" in refused.stderr and not (tmp_path / "out").exists()
    done = run(tmp_path, "--steps", steps, "--only", "2", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    res = json.loads((tmp_path / "out" / f"attention_draws-cpu-{SEQ}.json").read_text())
    assert [r["draw"] for r in res["rows"]] == [2, 1] and [r["seed"] for r in res["rows"]] == [2000, 1000]
    for model, measured in (("Transformer", 10.0), ("FoX (Pro)", 4.0)):
        assert res["estimates"][model]["estimated_step_s"][1] == pytest.approx(measured, abs=0.01)
    fox = res["estimates"]["FoX (Pro)"]["estimated_step_s"]
    assert res["estimates"]["ratio_at_timed_draw"] == pytest.approx(10.0 / 4.0, abs=2e-3)
    assert res["estimates"]["ratio_over_draws"] == pytest.approx(
        sum(res["estimates"]["Transformer"]["estimated_step_s"]) / sum(fox), abs=2e-3)
