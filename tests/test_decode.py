"""KV-cache greedy decoding equals the argmax of full forward passes, for RoPE (including the
LongRoPE switch across the original window) and FoX."""

from __future__ import annotations

import pytest
import torch

from longctx.model.config import FoxConfig, ModelConfig, RopeConfig
from longctx.model.decode import generate
from longctx.model.transformer import Transformer

BASE = dict(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_position_embeddings=32)
CONFIGS = {
    "llama": ModelConfig(**BASE),
    "longrope": ModelConfig(**BASE, rope=RopeConfig(type="longrope", original_max_position_embeddings=12,
                                                    short_factor=[1.0] * 4, long_factor=[4.0, 3.0, 2.0, 1.5])),
    "dynamic": ModelConfig(**BASE, rope=RopeConfig(type="dynamic", factor=2.0)),
    "fox_pro": ModelConfig(**BASE, rope=None, fox=FoxConfig()),
    "fox_llama": ModelConfig(**BASE, rope=None, fox=FoxConfig(qk_norm=False, output_gate=False,
                                                              output_norm=False, kv_shift=False)),
}


def full_forward_greedy(model: Transformer, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    tokens = prompt.clone()
    with torch.no_grad():
        for _ in range(steps):
            tokens = torch.cat((tokens, model(tokens)[-1].argmax()[None]))
    return tokens


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cached_greedy_equals_full_forward_argmax(name):
    torch.manual_seed(1)
    model = Transformer(CONFIGS[name]).double().eval()
    prompt = torch.randint(0, 61, (7,))
    steps = 30 if name != "dynamic" else 12  # LongRoPE crosses its window of 12 at step 6
    cached = generate(model, prompt, steps)
    assert torch.equal(cached, full_forward_greedy(model, prompt, steps))
    assert cached.numel() == 7 + steps


def test_generation_stops_at_eos():
    torch.manual_seed(1)
    model = Transformer(CONFIGS["llama"]).double().eval()
    prompt = torch.randint(0, 61, (5,))
    free = generate(model, prompt, 10)
    eos = int(free[7])
    stopped = generate(model, prompt, 10, eos_id=eos)
    assert int(stopped[-1]) == eos and stopped.numel() <= 8
