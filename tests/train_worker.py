"""A training process for the kill-and-resume test: a tiny model on a packed split."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from longctx.data.loader import PackedDataset
from longctx.model.config import ModelConfig
from longctx.model.transformer import Transformer
from longctx.train.loop import RunParams, train


def main(data: str, out: str, steps: int, every: int) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    ds = PackedDataset(data)
    cfg = ModelConfig(vocab_size=1024, d_model=32, n_layers=2, n_heads=4, ffn_dim=64, max_position_embeddings=512)
    model = Transformer(cfg, attention_backend="sdpa")
    train(model, ds, RunParams(steps=steps, micro_batch=2, grad_accum=2, lr=3e-3, checkpoint_every=every,
                                 keep_last=10), Path(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
