"""The eval stage's parts on real checkpoints: our greedy decoding gives transformers' answers on
an HF export, and bad input stops the stage with a clear error and no outputs."""

from __future__ import annotations

import pytest
import torch

from conftest import SMALL, stage_process
from longctx.config.eval_params import EvalParams
from longctx.data.tokenizer import TextTokenizer
from longctx.eval import suite
from longctx.model.config import ModelConfig, RopeConfig
from longctx.model.hf import save_hf, save_native
from longctx.model.transformer import Transformer


def small_model(vocab: int = 1024, window: int = 1024) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=vocab, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                      max_position_embeddings=window, rope=RopeConfig(theta=10000.0))
    model = Transformer(cfg, attention_backend="sdpa").eval()
    with torch.no_grad():  # a peaked output distribution: greedy choices are not near-ties
        model.lm_head.weight.mul_(20)
    return model


def test_our_decoding_gives_the_transformers_answers(small_project, tmp_path):
    tok = TextTokenizer.load(small_project / "data/tokens/tokenizer")
    model = small_model()
    save_hf(model, tmp_path / "hf", small_project / "data/tokens/tokenizer")
    enc = suite.Encoder(tok, chat=False)
    prompts = suite.build_prompts(enc, ["passkey", "niah_multikey", "json_kv"], [256, 768], 1, [0.5], 0,
                                  "Some text. " * 200)
    ours, theirs = suite.our_answerer(model, enc.eos()), suite.hf_answerer(tmp_path / "hf", enc.eos())
    ids = [enc.prompt(p) for p in prompts]
    together = ours(ids, [12] * len(ids))  # ours decodes the six prompts (two lengths) in one batch
    for p, a, b in zip(prompts, together, theirs(ids, [12] * len(ids)), strict=True):
        assert a == b[:len(a)] and len(a) >= 1, p.task
    # batches of a 1,000-token budget (the three 768-token prompts alone, the 256-token ones together)
    # score the rows, in the prompts' order, as one prompt a call does
    alone, _ = suite.run_tasks(ours, enc, [suite.part(prompts, ids)], "alone", batch_tokens=1)
    batched, _ = suite.run_tasks(ours, enc, [suite.part(prompts, ids)], "batched", batch_tokens=1000)
    assert batched == alone and [r["task"] for r in batched] == [p.task for p in prompts]


def test_stage_refuses_bad_checkpoints_and_lengths(project_copy):
    params = {**SMALL, "tracking": {"enabled": False}, "eval": {"lengths": [256], "samples": 1}}
    missing = stage_process(project_copy, "eval", params)
    assert missing.returncode == 2 and "checkpoint 'base' is missing" in missing.stderr

    names = ["base", "pretrain/stage1", "pretrain/stage2", "sft"]
    for n in names:
        save_native(small_model(vocab=64, window=256), project_copy / "models" / n)
    mismatch = stage_process(project_copy, "eval", params)
    assert mismatch.returncode == 2 and "the tokenizer does not match the checkpoint" in mismatch.stderr

    for n in names:
        save_native(small_model(window=256), project_copy / "models" / n)
    stranger = stage_process(project_copy, "eval", {**params, "eval": {"samples": 2, "samples_by_checkpoint": {
        "stage9": 1}}})
    assert stranger.returncode == 2 and "eval.samples_by_checkpoint: ['stage9'] name no checkpoint" in stranger.stderr
    too_long = stage_process(project_copy, "eval", {**params, "eval": {"lengths": [256, 4096]}})
    assert too_long.returncode == 2 and "eval.lengths: [4096] exceed every checkpoint's window" in too_long.stderr
    assert not (project_copy / "reports").exists() and not (project_copy / "metrics/eval.json").exists()


def test_a_checkpoint_asked_fewer_prompts_asks_the_first_of_every_cell():
    from types import SimpleNamespace

    prompts = [SimpleNamespace(task=t, length=n) for n in (256, 512) for t in ("passkey", "niah_single_noise")
               for _ in range(4)]
    assert suite.first_of_cells(prompts, 4, 3) == list(range(16))
    assert suite.first_of_cells(prompts, 1, 3) == [0, 4, 5, 6, 8, 12, 13, 14]  # every depth of the NIAH grid
    with pytest.raises(ValueError, match="more prompts than samples"):
        EvalParams(samples=2, samples_by_checkpoint={"base": 3})
