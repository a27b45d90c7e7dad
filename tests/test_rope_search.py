"""LongRoPE2 search: critical indices, the search space's constraints, baselines as factors,
needle sequences, and a deterministic search that resumes bitwise after SIGKILL."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from conftest import REPO
from longctx.data.loader import PackedDataset
from longctx.data.tokenizer import TextTokenizer
from longctx.errors import DataError
from longctx.eval import needle
from longctx.ropesearch.compare import coverage
from longctx.ropesearch.space import Space, critical_index, factors_of, longrope, method_ropes, periods_index, seeds


def period(i: int, half: int, theta: float) -> float:
    return 2 * math.pi * theta ** (i / half)


@pytest.mark.parametrize(("head_dim", "theta", "window"), [(128, 5e5, 8192), (96, 1e4, 4096), (32, 1e4, 512)])
def test_critical_indices_follow_the_periods(head_dim, theta, window):
    half = head_dim // 2
    tcd = critical_index(head_dim, theta, window)
    assert period(tcd, half, theta) >= window > period(tcd - 1, half, theta)
    ten = periods_index(head_dim, theta, window)
    assert window / period(ten, half, theta) <= 10 < window / period(ten - 1, half, theta)
    assert ten < tcd


def test_llama3_theoretical_critical_dimension():
    # Llama-3-8B: head 128, base 5e5, 8K window -> dimension 70 (frequency index 35)
    assert 2 * critical_index(128, 5e5, 8192) == 70


def test_operators_keep_the_search_constraints():
    space = Space(head_dim=64, theta=5e5, original=1024, target=8192)
    rng = np.random.default_rng(0)
    lo, hi = space.bounds
    pop = [space.random(rng) for _ in range(8)]
    for _ in range(300):
        a, b = (pop[i] for i in rng.choice(len(pop), 2, replace=False))
        child = space.mutate(space.crossover(a, b, rng, 0.5), rng, 0.3)
        pop[int(rng.integers(len(pop)))] = child
        v = np.asarray(child.values)
        assert np.all(np.diff(v) >= 0) and v.min() >= lo - 1e-9 and v.max() <= hi + 1e-9
        assert space.lo <= child.r <= space.tcd
        f = space.factors(child)
        # below r: NTK-style geometric ramp from 1 to lambda_r
        np.testing.assert_allclose(f[:child.r + 1], f[child.r] ** (np.arange(child.r + 1) / child.r))
    assert len({p.r for p in pop}) > 1  # r is searched, not fixed


def test_baselines_as_factors():
    space = Space(head_dim=64, theta=1e4, original=1024, target=4096)
    ropes = method_ropes(space, base_change_theta=1.6e5)
    f = {name: factors_of(r, space) for name, r in ropes.items()}
    np.testing.assert_allclose(f["original"], 1.0, rtol=1e-6)
    np.testing.assert_allclose(f["pi"], 4.0, rtol=1e-6)
    i = np.arange(32)
    np.testing.assert_allclose(f["ntk"], 4.0 ** (2 * i / 62), rtol=1e-5)  # s^(2i/(d-2)): 1 .. s
    np.testing.assert_allclose(f["base_change"], 16.0 ** (i / 32), rtol=1e-5)
    assert f["yarn"][0] == pytest.approx(1.0) and f["yarn"][-1] == pytest.approx(4.0, rel=1e-5)  # by parts
    assert np.all(np.diff(f["yarn"]) >= -1e-6)
    anchors = seeds(space, ropes)
    assert len(anchors) == len(set(anchors)) and all(space.lo <= a.r <= space.tcd for a in anchors)
    searched = longrope(space, space.factors(anchors[0]))
    assert searched.short_factor == [1.0] * 32 and len(searched.long_factor) == 32


def test_coverage_says_which_baselines_the_space_holds():
    """NTK is the space's corner (r at the last frequency, lambda = s there, temperature 1); PI,
    the original RoPE and YaRN are not in it, and the summary says how far each was moved."""
    wide = Space(head_dim=64, theta=1e4, original=1024, target=4096, critical_max="all", search_attention=True)
    cov = coverage(wide, method_ropes(wide, base_change_theta=1.6e5))
    assert cov["ntk"]["in_space"] and cov["ntk"]["factor_moved"] < 1e-5
    assert not cov["pi"]["in_space"] and not cov["original"]["in_space"] and not cov["yarn"]["in_space"]
    assert cov["original"]["factor_moved"] == pytest.approx(3.0, rel=1e-4)  # lambda 1 raised to s = 4
    assert cov["yarn"]["attention"] == pytest.approx(0.1 * np.log(4) + 1, rel=1e-5)
    paper = Space(head_dim=64, theta=1e4, original=1024, target=4096)  # r <= i_tcd, LongRoPE2's temperature
    narrow = coverage(paper, method_ropes(paper, None))
    assert not narrow["ntk"]["in_space"] and narrow["ntk"]["nearest_attention"] == paper.paper_attention


def test_needle_sequences_score_only_the_answer(small_project):
    data = PackedDataset(small_project / "data/packed/stage1/val")
    tok = TextTokenizer.load(small_project / "data/tokens/tokenizer")
    seqs = needle.sequences(data, tok, 512, 3, 0.05, seed=1)
    assert len(seqs) == 3 and all(len(s.ids) == 512 for s in seqs)
    for s in seqs:
        text = tok.tok.decode(s.ids.tolist())
        assert f"special magic numbers for {s.key} is: {s.value}" in text
        assert text.rstrip().endswith(f"The special magic number for {s.key} is: {s.value}.")
        assert text.index(s.value) < len(text) * 0.2  # the needle is near the start
        labels = needle.labels_of(s)
        scored = labels != -100
        assert int(scored.sum()) == len(s.answer)
        assert tok.tok.decode(labels[scored].tolist()).strip() == f"{s.value}."
    again = needle.sequences(data, tok, 512, 3, 0.05, seed=1)
    assert [s.value for s in again] == [s.value for s in seqs]  # seeded
    with pytest.raises(DataError, match="documents of >= 100000 tokens"):
        needle.sequences(data, tok, 100_000, 3, 0.05, seed=1)


def test_search_resumes_bitwise_after_sigkill(small_project, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO / "tests")])}
    worker = [sys.executable, str(REPO / "tests" / "search_worker.py"), str(small_project)]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    straight.mkdir()
    killed.mkdir()
    subprocess.run([*worker, str(straight), "6"], env=env, check=True, capture_output=True)
    proc = subprocess.Popen([*worker, str(killed), "6"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    state = killed / "state.json"
    deadline = time.time() + 300
    while proc.poll() is None and time.time() < deadline:
        if state.is_file() and json.loads(state.read_text())["generation"] >= 2:
            break
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert json.loads(state.read_text())["generation"] < 6, "the search finished before it was killed"
    subprocess.run([*worker, str(killed), "6"], env=env, check=True, capture_output=True)
    a = json.loads((straight / "result.json").read_text())
    b = json.loads((killed / "result.json").read_text())
    assert a == b and len(a["history"]) == 7
    best = [h["best"] for h in a["history"]]
    assert all(x >= y for x, y in zip(best, best[1:], strict=False))  # elitism: the best never gets worse
    # the fitness cache: fewer model evaluations than individuals seen over the generations
    assert a["evaluations"] < 8 * 7


def test_searched_factors_are_used_by_the_model():
    from longctx.model.config import ModelConfig
    from longctx.model.transformer import Transformer

    space = Space(head_dim=16, theta=1e4, original=64, target=256)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, ffn_dim=32,
                                    max_position_embeddings=256, rope=longrope(space, np.full(8, 4.0))), "reference")
    ids = torch.randint(0, 64, (256,))
    long_a = model(ids)
    model.cfg = model.cfg.model_copy(update={"rope": longrope(space, np.full(8, 8.0))})
    assert not torch.allclose(model(ids), long_a)  # long factors act past the original window
    short = torch.randint(0, 64, (64,))
    before = model(short)
    model.cfg = model.cfg.model_copy(update={"rope": longrope(space, np.full(8, 4.0))})
    torch.testing.assert_close(model(short), before)  # inside the window: short factors (1), unchanged


def test_stage_refuses_bad_input(project_copy):
    from conftest import SMALL, stage_process
    from longctx.model.config import FoxConfig, ModelConfig
    from longctx.model.hf import save_native
    from longctx.model.transformer import Transformer
    from longctx.train.models import longrope_factors

    fox = project_copy / "fox_ckpt"
    save_native(Transformer(ModelConfig(vocab_size=1024, d_model=32, n_layers=1, n_heads=2, ffn_dim=32,
                                        max_position_embeddings=256, rope=None, fox=FoxConfig())), fox)
    params = {**SMALL, "tracking": {"enabled": False}}
    no_rope = stage_process(project_copy, "rope_search",
                            {**params, "train": {**SMALL["train"], "pretrain": {**SMALL["train"]["pretrain"],
                                                                               "init": str(fox)}}})
    assert no_rope.returncode == 2 and "has no RoPE (a FoX model)" in no_rope.stderr
    assert not (project_copy / "models/rope_search").exists()

    short = stage_process(project_copy, "rope_search", {**params, "rope_search": {"target_length": 256,
                                                                                  "original_window": 512}})
    assert short.returncode == 2
    assert "rope_search.target_length: 256 must exceed the original window 512" in short.stderr

    wrong = project_copy / "factors.json"
    wrong.write_text(json.dumps({"long_factor": [2.0, 2.0, 2.0], "original_max_position_embeddings": 256}))
    model = Transformer(ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, ffn_dim=32))
    with pytest.raises(DataError, match="long_factor must be a list of 8 numbers"):
        longrope_factors(wrong, model)


def test_a_fox_profile_skips_the_search_with_every_output_dvc_expects(project_copy):
    """A model without RoPE has nothing to search: the stage says so and still writes each of its
    dvc.yaml outs and plots (a missing one fails `dvc repro` and the FoX pipeline)."""
    import yaml

    from conftest import REPO, SMALL, stage_process

    fox = {**SMALL, "model": {"arch": "fox"}, "tracking": {"enabled": False}}
    done = stage_process(project_copy, "rope_search", fox)
    assert done.returncode == 0, done.stderr
    assert "rope_search: skipped (the model has no RoPE (position: none, a FoX model))" in done.stdout
    declared = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]["rope_search"]
    paths = [e if isinstance(e, str) else next(iter(e)) for e in declared["outs"] + declared["plots"]]
    assert len(paths) >= 3 and [p for p in paths if not (project_copy / p).exists()] == []
    assert json.loads((project_copy / "models/rope_search/skipped.json").read_text())["reason"].startswith("the model")


def test_search_approaches_a_known_optimum_and_respects_budgets(tmp_path):
    from longctx.ropesearch.evolve import Settings, search

    space = Space(head_dim=32, theta=1e4, original=512, target=2048, critical_max="all")
    goal = space.factors(space.project(np.linspace(4.0, 7.5, 16), r=9, attention=space.paper_attention))

    def distance(ind):  # a smooth landscape with its minimum inside the space
        return float(((np.log(space.factors(ind)) - np.log(goal)) ** 2).sum())

    anchors = seeds(space, method_ropes(space, 1.6e5))
    state = search(space, distance, Settings(population=16, generations=30, seed=0), anchors, tmp_path / "a.json")
    start = min(distance(a) for a in anchors)
    assert state.history[-1]["best"] < 0.2 * start
    assert state.stopped is None and state.generation == 30
    capped = search(space, distance, Settings(population=16, generations=30, seed=0, max_evaluations=40), anchors,
                    tmp_path / "b.json")
    assert capped.stopped == "max_evaluations 40 reached" and capped.generation < 30
    assert len(capped.cache) < 40 + 16
