"""bench/tiny_retrieval.py on the small project's tokens: its synthetic sequences are packed the
way the pack stage packs kind `whole` (no document continues into another sequence) or `short`,
and a few steps of a variant train, score the eval's prompts and write its table and JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from bench import tiny_retrieval
from conftest import REPO
from longctx.data.tokenizer import TextTokenizer


def test_whole_documents_stay_in_their_sequence_and_short_ones_carry_over(small_project):
    tok = TextTokenizer.load(small_project / "data/tokens/tokenizer")
    bos = tok.token_id(tok.bos_token, "bos")
    for whole in (True, False):
        v = tiny_retrieval.Variant(seq_len=128, max_chars=900, whole=whole)
        seqs = tiny_retrieval.synthetic_sequences(tok, v, 40)
        assert len(seqs) == 40 and all(len(ids) == 128 == sum(lens) for ids, lens in seqs)
        starts = [ids[0] == bos for ids, _ in seqs]
        # a whole-packed sequence always opens with a document's BOS; carry-over opens some mid-document
        assert all(starts) if whole else not all(starts)


def test_a_variant_trains_scores_and_reports(small_project, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "bench/tiny_retrieval.py", "--tokens", str(small_project / "data/tokens"),
           "--variants", "tiny", "--set", "steps=6", "batch=2", "seq_len=256", "--evals", "2", "--prompts", "2",
           "--lengths", "256", "--out", str(tmp_path)]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "passkey / NIAH-single" in done.stdout
    (path,) = tmp_path.glob("tiny_retrieval-cpu-*.json")
    (result,) = json.loads(path.read_text())["results"]
    assert result["steps"] == 6 and result["d_model"] == 64 and [r["step"] for r in result["rows"]] == [3, 6]
    for row in result["rows"]:
        assert np.isfinite(row["nll_256"]) and row["nll_256"] > 0
        assert 0 <= row["passkey_256"] <= 1 and 0 <= row["niah_single_noise_256"] <= 1
    bad = subprocess.run(cmd[:6] + ["--set", "stepz=3"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown fields ['stepz']" in bad.stderr


def test_the_pack_stages_splits_feed_a_curriculum_and_saved_models_are_scored(small_project, tmp_path):
    """Variant.splits reads the pack stage's splits in turn (short_first of the steps from the first);
    --score loads a saved model as the eval stage does and scores it, an sft model in the chat template."""
    from longctx.data.loader import PackedDataset
    from longctx.model.config import ModelConfig
    from longctx.train.models import build, save_model

    packed = small_project / "data/packed"
    first, second = PackedDataset(packed / "stage1/train"), PackedDataset(packed / "sft/train")  # both 512
    v = tiny_retrieval.Variant(steps=10, batch=3, seq_len=512, short_first=0.4, splits=("stage1", "sft"))
    data = tiny_retrieval.training_data(v, None, [], packed)
    assert len(data) == 30 and [d.folder for d, _ in data.picks] == [first.folder] * 12 + [second.folder] * 18
    assert all(0 <= j < len(d) for d, j in data.picks)
    assert np.array_equal(data[29].input_ids, second[data.picks[29][1]].input_ids)
    with pytest.raises(ValueError, match="packed at \\[256, 512\\] tokens, the variant at 512"):
        tiny_retrieval.training_data(tiny_retrieval.dataclasses.replace(v, splits=("base", "stage1")), None, [], packed)

    tok = small_project / "data/tokens/tokenizer"
    model = build(ModelConfig(vocab_size=TextTokenizer.load(tok).vocab_size, d_model=32, n_layers=1, n_heads=2,
                              ffn_dim=64, max_position_embeddings=256), "sdpa", 0, "cpu")
    for name in ("model", "sft"):  # (the same weights: an sft model is asked in the chat template)
        save_model(model, tmp_path / name, tok)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "bench/tiny_retrieval.py", "--tokens", str(small_project / "data/tokens"),
           "--score", str(tmp_path / "model"), str(tmp_path / "sft"), "--prompts", "2", "--lengths", "256",
           "--out", str(tmp_path)]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (path,) = tmp_path.glob("tiny_retrieval-cpu-*.json")
    plain, chat = json.loads(path.read_text())["results"]
    assert plain["variant"] == str(tmp_path / "model") and plain["rows"][0]["nll_256"] > 0
    assert chat["variant"] == str(tmp_path / "sft") and chat["rows"][0]["nll_256"] != plain["rows"][0]["nll_256"]
