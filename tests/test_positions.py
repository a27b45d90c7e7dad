"""Position encodings beside RoPE: the learned table (APE), ALiBi and SeqPE: what each adds to
the logits, their limits, caching, decoding, saving, the training loop's SeqPE regularisers."""

from __future__ import annotations

import json
import random

import pytest
import torch
from pydantic import ValidationError

from longctx.config import ModelParams, RunParams
from longctx.data.loader import PackedDataset
from longctx.model import attention
from longctx.model.config import FoxConfig, LearnedPositions, ModelConfig, SeqPEConfig
from longctx.model.decode import Cache
from longctx.model.hf import load_native, save_native
from longctx.model.positions import (
    SeqPE,
    alibi_slopes,
    contrastive_batch,
    contrastive_loss,
    distillation_batch,
    distillation_loss,
)
from longctx.model.transformer import Transformer
from longctx.train.loop import train

ENCODINGS = {"learned": dict(learned_positions=LearnedPositions()), "alibi": dict(alibi=True),
             "seqpe": dict(seqpe=SeqPEConfig(digits=4, dim=32, heads=2))}


def model(kind: str, backend: str = "reference", window: int = 256, vocab: int = 97, **kw) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=vocab, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64,
                      max_position_embeddings=window, rope=None, **{**ENCODINGS.get(kind, {}), **kw})
    return Transformer(cfg, backend)


def test_digits_are_left_padded_and_the_end_is_an_error_or_clamped():
    pe = SeqPE(SeqPEConfig(digits=4, dim=16, heads=2))
    got = pe.digits(torch.tensor([0, 7, 123, 9999]))
    assert got.tolist() == [[0, 0, 0, 0], [0, 0, 0, 7], [0, 1, 2, 3], [9, 9, 9, 9]]
    with pytest.raises(ValueError, match="position 10000 is past the seqpe digits .10000 positions.; set seqpe.beyond"):
        pe.digits(torch.tensor([5, 10000]))
    clamped = SeqPE(SeqPEConfig(digits=4, dim=16, heads=2, beyond="clamp"))
    assert clamped.digits(torch.tensor([10000, 123456])).tolist() == [[9, 9, 9, 9]] * 2
    assert pe.encode(torch.arange(5)).shape == (5, 16)


def test_learned_table_adds_a_row_per_position_and_stops_or_clamps_at_its_end():
    m = model("learned", window=64)
    ids = torch.randint(0, 97, (40,))
    with torch.no_grad():
        m.positions.weight.zero_()
        plain = m(ids)
        m.positions.weight[5].fill_(1.0)  # only position 5 moves: the logits of tokens 0..4 stay
        moved = m(ids)
    torch.testing.assert_close(moved[:5], plain[:5])
    assert not torch.allclose(moved[5], plain[5])
    with pytest.raises(ValueError, match="position 79 is past the learned_positions table .64 positions."):
        m(torch.randint(0, 97, (80,)))
    clamp = model("learned", window=64, learned_positions=LearnedPositions(beyond="clamp"))
    assert torch.isfinite(clamp(torch.randint(0, 97, (80,)))).all()


def test_alibi_slopes_and_bias():
    assert alibi_slopes(8).tolist() == [2.0**-i for i in range(1, 9)]
    assert alibi_slopes(6).tolist() == [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3]
    # the fixed gate is ALiBi's bias -m_h (i - j), per document
    n, h, d = 12, 4, 8
    q, k, v = (torch.randn(n, h, d, dtype=torch.float64) for _ in range(3))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    m = alibi_slopes(h).double()
    got = attention.reference(q, k, v, cu, (-m).expand(n, h))
    for a, b in ((0, 5), (5, 12)):
        i = torch.arange(b - a)
        bias = -m[:, None, None] * (i[:, None] - i[None, :])
        logits = torch.einsum("qhd,khd->hqk", q[a:b], k[a:b]) / d**0.5 + bias
        want = torch.einsum("hqk,khd->qhd", logits.masked_fill(i[None, :] > i[:, None], -torch.inf).softmax(-1), v[a:b])
        torch.testing.assert_close(got[a:b], want)


def test_seqpe_biases_the_logits_by_position_parts():
    """With the projection to query and key parts zeroed, a SeqPE model is the same model with no
    position encoding; the parts enter as p_q(i).p_k(j) / sqrt(d), per head."""
    m, nope = model("seqpe"), model("none")
    nope.load_state_dict({k: v for k, v in m.state_dict().items() if k.startswith(("embed", "layers", "norm", "lm"))})
    ids = torch.randint(0, 97, (30,))
    with torch.no_grad():
        m.pe_qk.weight.zero_()
        torch.testing.assert_close(m(ids), nope(ids))
    q, k, v = (torch.randn(6, 2, 4, dtype=torch.float64) for _ in range(3))
    pq, pk = torch.randn(6, 2, 4, dtype=torch.float64), torch.randn(6, 2, 4, dtype=torch.float64)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    got = attention.reference(torch.cat((q, pq), -1), torch.cat((k, pk), -1), v, cu, scale=0.5)
    logits = (torch.einsum("qhd,khd->hqk", q, k) + torch.einsum("qhd,khd->hqk", pq, pk)) * 0.5
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    want = torch.einsum("hqk,khd->qhd", logits.masked_fill(~causal, -torch.inf).softmax(-1), v)
    torch.testing.assert_close(got, want)


def test_seqpe_cache_equals_recomputed_and_follows_the_weights():
    pe = SeqPE(SeqPEConfig(digits=4, dim=16, heads=2))
    for p in pe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    pos = torch.tensor([3, 0, 300, 3])
    with torch.no_grad():
        cached = pe(pos)
        torch.testing.assert_close(cached, pe.encode(pos))
        assert pe._table[1].shape[0] == 512  # one table for positions [0, 512)
        pe.out.weight.add_(1.0)  # a weight changes: the table is rebuilt
        torch.testing.assert_close(pe(pos), pe.encode(pos))
        assert not torch.allclose(pe(pos), cached)
        torch.testing.assert_close(pe(torch.tensor([4000])), pe.encode(torch.tensor([4000])))


@pytest.mark.parametrize("which", ["contrastive", "distillation"])
def test_each_regulariser_decreases_on_a_toy(which):
    torch.manual_seed(0)
    pe = SeqPE(SeqPEConfig(digits=4, dim=32, heads=2))
    for p in pe.parameters():
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=0.05 if which == "contrastive" else 0.5)
    rng = random.Random(0)

    def loss(r: random.Random) -> torch.Tensor:
        if which == "contrastive":
            return contrastive_loss(pe, *contrastive_batch(r, 5000))
        return distillation_loss(pe, *distillation_batch(r, 64, 5000), heads=2)

    before = loss(random.Random(1)).item()
    opt = torch.optim.Adam(pe.parameters(), lr=3e-3)
    for _ in range(80):
        opt.zero_grad()
        loss(rng).backward()
        opt.step()
    after = loss(random.Random(1)).item()
    # contrastive: from chance (ln 32 = 3.47) down; distillation: most of the way to zero
    assert after < (before - 0.2 if which == "contrastive" else 0.5 * before), (before, after)


def test_contrastive_labels_are_the_nearest_candidates():
    piv, cands, labels = contrastive_batch(random.Random(1), 20000, pivots=50)
    for n, c, i in zip(piv, cands, labels, strict=True):
        assert len(c) == 32 and n not in c and all(0 <= m < 20000 for m in c)
        assert abs(c[i] - n) == min(abs(m - n) for m in c)
    offsets, idx = distillation_batch(random.Random(1), 512, 20000)
    assert all(128 <= p < 20000 - 512 for p in offsets) and len(set(idx)) == 32 and max(idx) < 512


@pytest.mark.parametrize("kind", list(ENCODINGS))
def test_decoding_with_a_cache_equals_the_full_forward(kind):
    m = model(kind)
    ids = torch.randint(0, 97, (40,))
    with torch.no_grad():
        full = m(ids)
        cache = Cache(m.cfg.n_layers)
        parts = [m(ids[:25], cache=cache)] + [m(ids[i:i + 1], cache=cache) for i in range(25, 40)]
    torch.testing.assert_close(torch.cat(parts), full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", list(ENCODINGS))
def test_every_backend_that_can_run_it_agrees_and_save_load_round_trips(kind, tmp_path):
    m = model(kind)
    ids, cu = torch.randint(0, 97, (50,)), [0, 20, 50]
    want = m(ids, cu)
    for backend in ("sdpa", "fox"):  # the Triton kernel in its interpreter here
        other = model(kind, backend=backend)
        other.load_state_dict(m.state_dict())
        torch.testing.assert_close(other(ids, cu), want, rtol=1e-4, atol=1e-5)
    save_native(m, tmp_path / "ckpt")
    loaded = load_native(tmp_path / "ckpt", attention_backend="reference")
    assert loaded.cfg.position == kind
    torch.testing.assert_close(loaded(ids, cu), want)


def test_bad_settings_are_named():
    with pytest.raises(ValidationError, match="seqpe.digits 3 cannot write position 1023"):
        model("seqpe", window=1024, seqpe=SeqPEConfig(digits=3))
    with pytest.raises(ValidationError, match="seqpe.digits 3 cannot write position 1023"):
        ModelParams(d_model=32, n_layers=1, n_heads=2, ffn_dim=64, max_position_embeddings=1024, position="seqpe",
                    seqpe=SeqPEConfig(digits=3))
    with pytest.raises(ValidationError, match="position"):
        ModelParams(d_model=32, n_layers=1, n_heads=2, ffn_dim=64, max_position_embeddings=64, position="sinusoid")
    with pytest.raises(ValidationError, match="one position encoding at a time"):
        model("alibi", learned_positions=LearnedPositions())
    with pytest.raises(ValidationError, match="a FoX model has its own"):
        model("alibi", fox=FoxConfig())


@pytest.mark.parametrize("position", ["rope", "learned", "alibi", "seqpe", "none"])
def test_params_choose_the_position_encoding(position):
    params = ModelParams(d_model=32, n_layers=1, n_heads=2, ffn_dim=64, max_position_embeddings=64, position=position)
    assert params.as_model_config(97).position == position
    assert params.model_copy(update={"position": None}).as_model_config(97).position == "rope"


def test_training_a_seqpe_model_logs_its_regularisers(small_project, tmp_path):
    data = PackedDataset(small_project / "data/packed/stage1/train")
    m = model("seqpe", window=data.seq_len, vocab=int(data.index["vocab_size"]),
              seqpe=SeqPEConfig(digits=5, dim=32, heads=2))
    run = dict(steps=6, lr=3e-3, checkpoint_every=6)
    train(m, data, RunParams(**run, seqpe={"shift_rate": 0.5}), tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and all(r["seqpe_contrastive"] > 0 and r["seqpe_regularisers_ms"] > 0 for r in rows)
    shifted = [r for r in rows if "seqpe_distill" not in r]  # a shifted step skips the distillation
    assert 0 < len(shifted) < 6 and all(r["seqpe_distill"] >= 0 for r in rows if r not in shifted)
    with pytest.raises(Exception, match="seqpe.max_position 200000 is past what the model's 5 digits write"):
        train(m, data, RunParams(**run, seqpe={"max_position": 200000}), tmp_path / "again")


def test_a_longer_window_keeps_the_weights_and_grows_a_learned_table():
    from longctx.train.models import with_positions

    m = model("learned", window=64)
    ids = torch.randint(0, 97, (60,))
    longer = with_positions(m, None, 128)
    assert longer.positions.weight.shape == (128, 32)
    torch.testing.assert_close(longer(ids), m(ids))  # inside the old window nothing changed
    torch.testing.assert_close(longer.positions.weight[64:], m.positions.weight[-1:].expand(64, -1))
    seq = model("seqpe", window=64)
    torch.testing.assert_close(with_positions(seq, None, 4096)(ids), seq(ids))
    with pytest.raises(ValidationError, match="seqpe.digits 4 cannot write position 99999"):
        with_positions(seq, None, 100000)


def test_a_seqpe_model_goes_through_base_pretrain_sft_and_eval(project_copy):
    """The stages as a user runs them, with model.position: seqpe: the base model is SeqPE,
    rope_search records that it skipped, pretrain and SFT continue it, eval scores it at every
    length (no RoPE window: none is skipped)."""
    from conftest import SMALL, stage_process
    from longctx.model.hf import native_config

    params = {**SMALL, "tracking": {"enabled": False},
              "model": {**SMALL["model"], "position": "seqpe", "seqpe": {"digits": 5, "dim": 16, "heads": 2}}}
    for name in ("base", "rope_search", "pretrain", "sft", "eval"):
        done = stage_process(project_copy, name, params)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert native_config(project_copy / "models/base").position == "seqpe"
    assert native_config(project_copy / "models/sft").seqpe.dim == 16
    skipped = json.loads((project_copy / "models/rope_search/skipped.json").read_text())
    assert "no RoPE (position: seqpe)" in skipped["reason"]
    results = json.loads((project_copy / "metrics/eval.json").read_text())
    assert not [s for s in results["skipped"] if "window" in s.get("reason", "")]
    for checkpoint in ("base", "sft"):
        assert {int(n) for by in results["tasks"][checkpoint].values() for n in by} == {256, 512}


def test_positions_bench_trains_and_scores_every_encoding(small_project, tmp_path):
    from bench.positions import MULTIPLES, main

    got = main(["--data", str(small_project / "data/packed/stage2"), "--train-len", "64", "--steps", "3",
                "--micro-batch", "2", "--shape", "tiny", "--eval-docs", "2", "--work", str(tmp_path / "work"),
                "--out", str(tmp_path)])
    rows = {r["model"]: r for r in got["rows"]}
    assert list(rows) == ["RoPE", "learned (APE)", "ALiBi", "SeqPE", "FoX (Pro)"]
    assert [r["position"] for r in rows.values()] == ["rope", "learned", "alibi", "seqpe", "none"]
    for r in rows.values():
        assert r["tokens_per_s"] > 0 and all(1 < r[f"ppl_{m}L"] < 1e4 for m in MULTIPLES)
    assert rows["SeqPE"]["seqpe_regularisers_ms"] > 0 and rows["RoPE"]["tokens_per_s_vs_rope"] == 1.0
    assert set(got["claim"]) == {"SeqPE below RoPE beyond L", "SeqPE below learned (APE) beyond L"}
    assert json.loads(got["json"].read_text())["rows"] == got["rows"] and got["json"].with_suffix(".png").is_file()


def test_a_non_finite_regulariser_is_named_as_the_cause():
    from longctx.train.loop import QueuedStep, TrainingDiverged

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    nan = torch.tensor(float("nan"))
    step = QueuedStep(torch.tensor(2.0), nan, 10, opt, {"seqpe_contrastive": torch.tensor(3.0), "seqpe_distill": nan})
    with pytest.raises(TrainingDiverged, match="^seqpe_distill is nan$"):
        step.result()
    assert QueuedStep(torch.tensor(2.0), torch.tensor(1.0), 10, opt, {"seqpe_distill": torch.tensor(0.5)}).result() \
        == (2.0, 1.0, 10)
