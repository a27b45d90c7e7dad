"""bench/attention.py's gates from a trained FoX checkpoint (--gates-from): the log forget gates
every layer computes, on random tokens or a packed split, with clear refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bench.attention import model_gates
from longctx.data.loader import PackedDataset
from longctx.model.config import FoxConfig, ModelConfig, RopeConfig
from longctx.model.hf import save_native
from longctx.model.transformer import Transformer


def saved(tmp_path, vocab: int, fox: bool = True):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=vocab, d_model=32, n_layers=2, n_heads=4, ffn_dim=64, max_position_embeddings=4096,
                      rope=None if fox else RopeConfig(), fox=FoxConfig() if fox else None)
    model = Transformer(cfg)
    save_native(model, tmp_path / "ckpt")
    return model, tmp_path / "ckpt"


def test_gates_are_what_each_layer_computes(tmp_path):
    model, folder = saved(tmp_path, vocab=97)
    gates = model_gates(folder, 300, device="cpu")
    assert gates.shape == (300, 2 * 4) and torch.isfinite(gates).all() and (gates <= 0).all()
    ids = torch.randint(0, 97, (300,), generator=torch.Generator().manual_seed(0))
    first = model.layers[0]
    want = F.logsigmoid(first.self_attn.fgate(first.input_layernorm(model.embed_tokens(ids))))
    torch.testing.assert_close(gates[:, :4], want.detach())
    assert not torch.allclose(gates[:, 4:], gates[:, :4])  # the second layer's own gates


def test_gates_on_packed_text_and_refusals(tmp_path, small_project):
    split = small_project / "data/packed/stage1/train"
    _, folder = saved(tmp_path, vocab=1024)
    assert model_gates(folder, 1500, split, device="cpu").shape == (1500, 8)
    _, small_vocab = saved(tmp_path / "other", vocab=97)
    with pytest.raises(SystemExit, match="past the checkpoint's vocabulary of 97"):
        model_gates(small_vocab, 500, split, device="cpu")
    _, llama = saved(tmp_path / "llama", vocab=1024, fox=False)
    with pytest.raises(SystemExit, match="not a FoX model"):
        model_gates(llama, 500, device="cpu")


def test_train_fox_makes_a_model_whose_gates_the_bench_reads(tmp_path, small_project):
    from bench.train_fox import main

    split = small_project / "data/packed/stage1"
    summary = main(["--data", str(split), "--shape", "tiny", "--steps", "6", "--lr", "3e-3",
                    "--out", str(tmp_path / "fox")])
    assert summary["val_loss_after"] < summary["val_loss_before"] - 0.1  # it learned from the text
    assert summary["vocab_size"] == int(PackedDataset(split / "train").index["vocab_size"])
    gates = model_gates(tmp_path / "fox/model", 700, split / "val", device="cpu")
    assert gates.shape == (700, 2 * 4) and (gates < 0).all()
