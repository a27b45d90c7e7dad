"""The rope_search stage's library half (ropesearch/compare.py): the search and the method table
on real packed documents with a small model, the acceptance verdict, and the HF longrope form
the factors are written in and read back from (model/rope.py, one place for both)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from longctx.config import RopeSearchParams
from longctx.data.loader import PackedDataset
from longctx.data.tokenizer import TextTokenizer
from longctx.errors import DataError
from longctx.model.config import ModelConfig, RopeConfig
from longctx.model.rope import from_hf, hf_rope_parameters
from longctx.model.transformer import Transformer
from longctx.ropesearch.compare import (
    SEARCHED,
    needle_sets,
    plot_factors,
    same_as,
    search_and_compare,
    use_rope,
    verdict,
)
from longctx.ropesearch.space import Space, longrope, method_ropes
from longctx.train.models import longrope_factors


def model(window: int = 128) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=1024, d_model=32, n_layers=2, n_heads=2, ffn_dim=64,
                                   max_position_embeddings=window, rope=RopeConfig(theta=10000.0)), "sdpa").eval()


def test_search_and_compare_score_every_method_on_the_same_sequences(small_project, tmp_path):
    data = PackedDataset(small_project / "data/packed/stage1/val")
    tok = TextTokenizer.load(small_project / "data/tokens/tokenizer")
    m = model()
    space = Space(m.cfg.dim_head, 10000.0, 128, 512)
    rs = RopeSearchParams(sequences=2, table_sequences=2, population=6, generations=2, seed=1)
    needles = needle_sets(data, tok, space, rs)
    assert [len(n) for n in needles] == [2, 2]
    assert not {s.value for s in needles[0]} & {s.value for s in needles[1]}  # held out: other needles
    result = search_and_compare(m, space, data, tok, rs, needles, 160000.0, [128, 512], tmp_path / "state.json")
    methods = {"original", "pi", "ntk", "yarn", "base_change", SEARCHED}
    assert {(r["method"], r["length"]) for r in result.table} == {(x, n) for x in methods for n in (128, 512)}
    assert all(("needle_ppl_search" in r) == (r["length"] == 512) for r in result.table)
    assert all(r["needle_ppl"] > 1 and r["plain_ppl"] > 1 for r in result.table)
    # the search is seeded with every baseline and keeps the best: on the search's own sequences
    # it is not worse than any of them
    assert result.summary["searched_not_worse"] is True
    assert result.summary["target_length"] == 512 and result.summary["generations"] == 2
    assert set(result.factors) == methods and all(len(f) == 8 for f in result.factors.values())
    np.testing.assert_allclose(result.factors["pi"], 4.0, rtol=1e-5)  # position interpolation: s everywhere
    # the attention factors at the target: 1 for PI and NTK, YaRN's 0.1 ln s + 1, the searched one's own
    assert result.attention["pi"] == result.attention["ntk"] == 1.0
    assert result.attention["yarn"] == pytest.approx(0.1 * np.log(4) + 1, rel=1e-6)
    assert result.attention[SEARCHED] == pytest.approx(result.state.population[0].attention, rel=1e-6)
    assert result.summary["searched_equals"] == same_as(result.factors, result.attention)
    assert set(result.summary["baselines_in_space"]) == methods - {SEARCHED}
    assert all(r["needle_ppl_lo"] <= r["needle_ppl"] <= r["needle_ppl_hi"] for r in result.table if r["length"] == 512)
    assert json.loads((tmp_path / "state.json").read_text())["generation"] == 2
    plot_factors(result.factors, space, tmp_path / "factors.png")
    assert (tmp_path / "factors.png").stat().st_size > 10_000


def test_the_interval_is_over_sequences():
    from longctx.eval.needle import ppl_interval

    one = ppl_interval(np.array([6.0]), np.array([3]))
    assert one == pytest.approx((np.exp(2.0), np.exp(2.0)))  # one sequence: no spread to resample
    alike = ppl_interval(np.array([6.0, 6.0, 6.0, 6.0]), np.array([3, 3, 3, 3]))
    apart = ppl_interval(np.array([0.3, 12.0, 3.0, 9.0]), np.array([3, 3, 3, 3]))
    assert alike[1] - alike[0] < 1e-9 < apart[1] - apart[0]
    assert apart[0] < np.exp(24.3 / 12) < apart[1]  # the point estimate lies inside


def table(searched: float, searched_fit: float) -> list[dict]:
    def at_target(method: str, held_out: float, fit: float) -> dict:
        return {"method": method, "length": 512, "needle_ppl": held_out, "needle_ppl_lo": held_out * 0.9,
                "needle_ppl_hi": held_out * 1.1, "needle_ppl_search": fit}

    return [at_target("pi", 3.0, 2.0), at_target("yarn", 2.5, 2.2),
            {"method": "yarn", "length": 128, "needle_ppl": 1.1}, at_target(SEARCHED, searched, searched_fit)]


def test_the_verdict_compares_with_the_best_baseline_on_each_set():
    v = verdict(table(2.4, 1.9), 512)
    assert (v["best_baseline"], v["best_baseline_needle_ppl"]) == ("yarn", 2.5)  # held out
    assert (v["best_baseline_search_set"], v["best_baseline_needle_ppl_search_set"]) == ("pi", 2.0)
    assert v["searched_not_worse"] and v["searched_not_worse_held_out"]
    assert v["searched_needle_ppl_interval"] == pytest.approx([2.16, 2.64])
    assert v["best_baseline_needle_ppl_interval"] == pytest.approx([2.25, 2.75])
    v = verdict(table(2.6, 2.0001), 512)  # equal up to float noise still passes; worse does not
    assert v["searched_not_worse"] and not v["searched_not_worse_held_out"]
    assert not verdict(table(2.4, 2.01), 512)["searched_not_worse"]


def test_the_factors_file_is_hf_longrope_and_reads_back(tmp_path):
    space = Space(16, 10000.0, 128, 512)
    searched = longrope(space, np.linspace(1.0, 6.0, 8), 1.2)
    doc = hf_rope_parameters(searched)
    assert doc["rope_type"] == "longrope" and doc["factor"] == 4.0 and doc["original_max_position_embeddings"] == 128
    path = tmp_path / "factors.json"
    path.write_text(json.dumps(doc | {"searched_on": "models/base"}))
    m = model()
    assert longrope_factors(path, m) == searched  # the file's extra keys are ignored, the model's base kept
    for rope in [*method_ropes(space, 160000.0).values(), searched]:
        assert from_hf(hf_rope_parameters(rope)) == rope
    path.write_text(json.dumps(doc | {"long_factor": [1.0] * 7}))
    with pytest.raises(DataError, match="long_factor must be a list of 8 numbers"):
        longrope_factors(path, m)
    path.write_text(json.dumps(doc | {"attention_factor": -1}))
    with pytest.raises(DataError, match=f"{path}: .*attention_factor"):
        longrope_factors(path, m)


def test_use_rope_changes_positions_only():
    m = model()
    ids = torch.randint(0, 1024, (512,), generator=torch.Generator().manual_seed(0))
    weights = {k: v.clone() for k, v in m.state_dict().items()}
    before = m(ids)
    space = Space(16, 10000.0, 128, 512)
    assert use_rope(m, longrope(space, np.full(8, 4.0)), 512) is m
    assert m.cfg.max_position_embeddings == 512 and m.cfg.rope.type == "longrope"
    assert not torch.allclose(m(ids), before)
    assert all(torch.equal(v, weights[k]) for k, v in m.state_dict().items())
