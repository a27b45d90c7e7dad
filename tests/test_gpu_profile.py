"""The one-GPU profile (`gpu-64k`, issue 32) on a CPU: its configurations build (the ~100M model
on the meta device, in the Llama and the FoX (Pro) + ACP variants; the curriculum's splits, windows
and RoPE steps; the eval lengths), and its data stages run on a small sample of its own sources:
installed packages as repository-level documents and retrieval documents sized to each window."""

from __future__ import annotations

import json

import pytest

from conftest import run_stages
from longctx import config
from longctx.data.loader import PackedDataset
from longctx.train.models import build

FOX_ACP = {"model": {"arch": "fox"},
           "train": {"base": {"acp_eps": 4.54e-5}, "sft": {"acp_eps": 4.54e-5}}}


def parameters(cfg: config.Params, vocab: int) -> int:
    model = build(cfg.model.as_model_config(vocab), "sdpa", device="meta")
    return sum(p.numel() for p in model.parameters())


def test_the_gpu_profile_is_prolong_scaled_to_one_gpu():
    cfg = config.resolve({"profile": "gpu-64k"})
    vocab = cfg.tokenize.tokenizer.train.vocab_size
    assert 80e6 <= parameters(cfg, vocab) <= 130e6
    assert cfg.model.max_position_embeddings == 4096
    assert {s: p.seq_len for s, p in cfg.pack.splits.items()} == {"base_short": 4096, "base": 4096, "stage1": 16384,
                                                                  "stage2": 65536, "sft": 4096}
    # the base's curriculum: short retrieval documents first (half the steps), then across the window
    assert [(p.split, 2 * p.steps) for p in cfg.train.base.curriculum] == [("base_short", cfg.train.base.steps)]
    assert "retrieval" not in cfg.pack.splits["base_short"].mix and "retrieval" in cfg.pack.splits["base"].mix
    stages = cfg.train.pretrain.stages
    assert [s.split for s in stages] == ["stage1", "stage2"]
    theta = [cfg.model.rope_theta] + [s.rope_theta for s in stages]
    assert theta[1] / theta[0] == theta[2] / theta[1] == 16  # ProLong's base change per stage
    assert cfg.rope_search.target_length == 65536
    assert cfg.eval.lengths == [4096, 16384, 32768, 65536]
    assert {"passkey", "niah_single_noise", "niah_multikey", "json_kv"} <= set(cfg.eval.tasks)
    assert cfg.chunk_lengths("stage2", "code_repos") == {65536: 1.0}
    # the search fits and holds out needle sequences, each from its own 64K validation document
    assert cfg.rope_search.sequences + cfg.rope_search.table_sequences <= 3
    code = cfg.corpora.domains["code_repos"].sources[0]
    assert code.builtin == "stdlib_repos" and code.site_packages


def test_its_fox_acp_variant_builds():
    cfg = config.resolve({"profile": "gpu-64k", **FOX_ACP})
    assert cfg.model.arch == "fox" and cfg.train.base.acp_eps and cfg.train.sft.acp_eps
    assert 80e6 <= parameters(cfg, cfg.tokenize.tokenizer.train.vocab_size) <= 130e6


def synthetic(lo: int, hi: int, max_bytes: int) -> dict:
    return {"sources": [{"synthetic": {"formats": ["passkey", "kv", "multikey", "multiquery"], "min_chars": lo,
                                       "max_chars": hi}, "max_bytes": max_bytes}]}


@pytest.mark.slow
def test_its_data_stages_run_on_a_sample(tmp_path):
    """The profile's own sources and splits, budgets cut ~100x: installed packages become long
    documents, every split is packed at its length, and no retrieval document loses its question
    to a window it does not fit."""
    sample = {
        "profile": "gpu-64k",
        "corpora": {"domains": {
            "code_repos": {"sources": [{"builtin": "stdlib_repos", "site_packages": True, "max_bytes": 8_000_000}]},
            "modules": {"sources": [{"builtin": "stdlib_short", "part": "modules", "max_bytes": 1_500_000}]},
            "chat": {"sources": [{"builtin": "stdlib_sft", "max_bytes": 200_000}]},
            "retrieval_short": synthetic(120, 1200, 600_000),
            "retrieval": synthetic(1200, 13000, 1_200_000),
            "retrieval_16k": synthetic(13000, 52000, 1_500_000),
            "retrieval_64k": synthetic(52000, 200000, 1_500_000)}},
        "tokenize": {"tokenizer": {"train": {"sample_bytes": 2_000_000}}, "num_workers": 1},
        # a sample's few documents: its validation part must fill a sequence, its shares come coarser
        "pack": {"val_fraction": 0.3, "tolerance": 0.15},
        "tracking": {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
    }
    run_stages(tmp_path, ["corpora", "tokenize", "pack"], sample)
    lengths = json.loads((tmp_path / "metrics/tokenize.json").read_text())["lengths"]
    assert lengths["code_repos"]["docs"] >= 2 and lengths["code_repos"]["pct_gt_64k"] > 0  # packages past 64K
    windows = {"retrieval_short": "base", "retrieval": "base", "retrieval_16k": "stage1", "retrieval_64k": "stage2"}
    for domain, split in windows.items():
        chunk = config.resolve({"profile": "gpu-64k"}).pack.splits[split].base_len  # whole documents' chunk
        assert lengths[domain]["max"] <= chunk, (domain, lengths[domain]["max"], chunk)  # the question stays in
    for split, length in {"base_short": 4096, "base": 4096, "stage1": 16384, "stage2": 65536, "sft": 4096}.items():
        data = PackedDataset(tmp_path / f"data/packed/{split}/train")
        assert data.seq_len == length and len(data) >= 1, split
