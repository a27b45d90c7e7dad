"""A rope_search process for the kill-and-resume test: a small real model scores needle sequences
built from a packed validation split; the search state goes to <out>/state.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from longctx.data.loader import PackedDataset
from longctx.data.tokenizer import TextTokenizer
from longctx.eval import needle
from longctx.model.config import ModelConfig, RopeConfig
from longctx.model.transformer import Transformer
from longctx.ropesearch.evolve import Settings, search
from longctx.ropesearch.space import Space, method_ropes, rope_of, seeds


def main(project: str, out: str, generations: int) -> None:
    torch.set_num_threads(1)
    root = Path(project)
    data = PackedDataset(root / "data/packed/stage1/val")
    tok = TextTokenizer.load(root / "data/tokens/tokenizer")
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=1024, d_model=32, n_layers=2, n_heads=2, ffn_dim=64,
                                    max_position_embeddings=128, rope=RopeConfig(theta=10000.0)), "sdpa").eval()
    space = Space(model.cfg.dim_head, 10000.0, 128, 512)
    seqs = needle.sequences(data, tok, 512, 2, 0.05, seed=0)

    def fitness(ind):
        model.cfg = model.cfg.model_copy(update={"rope": rope_of(space, ind),
                                                 "max_position_embeddings": 512})
        return needle.needle_nll(model, seqs)

    state = search(space, fitness, Settings(population=8, generations=generations, seed=3),
                   seeds(space, method_ropes(space, 160000.0)), Path(out) / "state.json")
    (Path(out) / "result.json").write_text(json.dumps({"history": state.history, "evaluations": len(state.cache)}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
