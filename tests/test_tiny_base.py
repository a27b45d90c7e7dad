"""The tiny profile's pretrained base (checkpoints/tiny-base): what the tiny-scratch profile makes,
recorded as made, and the script that remakes it."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import REPO, SMALL

sys.path.insert(0, str(REPO / "bench"))
import tiny_base  # noqa: E402

from longctx import config  # noqa: E402
from longctx.data.tokenizer import TextTokenizer  # noqa: E402
from longctx.train.models import load_model  # noqa: E402

BASE = REPO / "checkpoints" / "tiny-base"


def test_the_committed_base_is_what_tiny_scratch_makes():
    tiny, scratch = config.resolve({"profile": "tiny"}), config.resolve({"profile": "tiny-scratch"})
    assert (REPO / tiny.train.pretrain.init).resolve() == BASE == (REPO / tiny.tokenize.tokenizer.path).resolve()
    made = json.loads((BASE / "provenance.json").read_text())
    # a change to tiny-scratch's base recipe fails here until `python bench/tiny_base.py` remakes it
    assert made["recipe"] == json.loads(json.dumps(tiny_base.recipe(scratch)))
    summary = json.loads((BASE / "summary.json").read_text())
    assert TextTokenizer.load(BASE).fingerprint == summary["tokenizer"] == made["tokenizer"]
    model = load_model(BASE)
    assert model.cfg.vocab_size == scratch.tokenize.tokenizer.train.vocab_size
    assert (model.cfg.d_model, model.cfg.n_layers, model.cfg.max_position_embeddings) == (
        scratch.model.d_model, scratch.model.n_layers, scratch.model.max_position_embeddings)
    assert summary["steps"] == scratch.train.base.steps and summary["val_loss"] < 1.0


def test_the_script_makes_a_base_and_leaves_nothing_on_failure(tmp_path):
    out = tmp_path / "base"
    made = tiny_base.make({**SMALL}, out, tmp_path / "work")
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [*tiny_base.MODEL_FILES, *tiny_base.TOKENIZER_FILES, "provenance.json"])
    assert made["recipe"]["train.base"]["steps"] == 4 and set(made["stage_seconds"]) == set(tiny_base.STAGES)
    assert TextTokenizer.load(out).fingerprint == made["tokenizer"]
    assert load_model(out).cfg.d_model == SMALL["model"]["d_model"]
    # a profile that trains no base: refused before any stage runs, `out` as it was
    before = (out / "model.safetensors").read_bytes()
    with pytest.raises(SystemExit, match="train.base is not set"):
        tiny_base.main(["--out", str(out), "--work", str(tmp_path / "w2"), "--params", str(_params(tmp_path))])
    assert (out / "model.safetensors").read_bytes() == before and not (tmp_path / "w2").exists()
    with pytest.raises(SystemExit, match=r"--params .*missing\.yaml: .*No such file"):
        tiny_base.main(["--out", str(out), "--params", str(tmp_path / "missing.yaml")])
    (tmp_path / "list.yaml").write_text("- profile\n")
    with pytest.raises(SystemExit, match="must be a mapping"):
        tiny_base.main(["--out", str(out), "--params", str(tmp_path / "list.yaml")])


def _params(folder):
    path = folder / "no-base.yaml"
    path.write_text("profile: tiny\n")
    return path
