"""bench/tiny_retrieval.py on the small project's tokens: its synthetic sequences are packed the
way the pack stage packs kind `whole` (no document continues into another sequence) or `short`,
and a few steps of a variant train, score the eval's prompts and write its table and JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

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
