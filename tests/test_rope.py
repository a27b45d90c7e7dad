"""RoPE scaling: our frequencies and attention factors equal HF transformers' for every type."""

from __future__ import annotations

import math

import pytest
import torch

from longctx.model.config import RopeConfig
from longctx.model.rope import cos_sin, from_hf, hf_rope_parameters, inverse_frequencies, rotate

HEAD_DIM = 64
MAX_POS = 32768

CASES = {
    "default": RopeConfig(theta=500000.0),
    "prolong_base": RopeConfig(theta=8e6),
    "linear": RopeConfig(type="linear", theta=10000.0, factor=4.0),
    "dynamic": RopeConfig(type="dynamic", theta=10000.0, factor=4.0),
    "yarn": RopeConfig(type="yarn", theta=10000.0, factor=8.0, original_max_position_embeddings=4096),
    "yarn_mscale": RopeConfig(type="yarn", theta=10000.0, factor=8.0, original_max_position_embeddings=4096,
                              mscale=0.707, mscale_all_dim=0.707, beta_fast=16, beta_slow=2),
    "llama3": RopeConfig(type="llama3", theta=500000.0, factor=8.0, original_max_position_embeddings=8192),
    "longrope": RopeConfig(type="longrope", theta=10000.0, original_max_position_embeddings=4096,
                           short_factor=[1.0 + 0.01 * i for i in range(HEAD_DIM // 2)],
                           long_factor=[1.0 + 0.3 * i for i in range(HEAD_DIM // 2)]),
}


def hf_reference(cfg: RopeConfig, seq_len: int | None):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf_cfg = LlamaConfig(hidden_size=HEAD_DIM * 4, num_attention_heads=4, head_dim=HEAD_DIM,
                         max_position_embeddings=MAX_POS, rope_parameters=hf_rope_parameters(cfg))
    if cfg.type == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(hf_cfg)
    return ROPE_INIT_FUNCTIONS[cfg.type](hf_cfg, None, seq_len=seq_len)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("seq_len", [None, 2048, 4097, 65536])
def test_matches_transformers(name, seq_len):
    cfg = CASES[name]
    ours, ours_scale = inverse_frequencies(cfg, HEAD_DIM, MAX_POS, seq_len)
    ref, ref_scale = hf_reference(cfg, seq_len)
    torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=0)
    assert ours_scale == pytest.approx(ref_scale, rel=1e-9)


def test_longrope_switches_at_the_original_window_and_scales_attention():
    cfg = CASES["longrope"]
    short, scale = inverse_frequencies(cfg, HEAD_DIM, MAX_POS, 4096)
    long, _ = inverse_frequencies(cfg, HEAD_DIM, MAX_POS, 4097)
    assert not torch.equal(short, long)
    assert scale == pytest.approx(math.sqrt(1 + math.log(MAX_POS / 4096) / math.log(4096)))


def test_hf_round_trip_and_errors():
    for cfg in CASES.values():
        assert from_hf(hf_rope_parameters(cfg)) == cfg
    with pytest.raises(ValueError, match="needs"):
        RopeConfig(type="llama3", factor=8.0)
    bad = CASES["longrope"].model_copy(update={"long_factor": [1.0] * 3})
    with pytest.raises(ValueError, match="long_factor has 3 values"):
        inverse_frequencies(bad, HEAD_DIM, MAX_POS, 5000)
    with pytest.raises(ValueError, match="not supported"):
        from_hf({"rope_type": "linear", "factor": 2.0, "bogus": 1})


def test_rotation_preserves_norms_and_relative_positions():
    inv, scale = inverse_frequencies(CASES["default"], HEAD_DIM, MAX_POS)
    q, k = torch.randn(HEAD_DIM, dtype=torch.float64), torch.randn(HEAD_DIM, dtype=torch.float64)

    def at(x, p):
        cos, sin = cos_sin(inv, scale, torch.tensor(p), torch.float64)
        return rotate(x, cos, sin)

    torch.testing.assert_close(at(q, 5).norm(), q.norm())
    # the score depends only on the distance between positions
    torch.testing.assert_close(at(q, 9) @ at(k, 5), at(q, 109) @ at(k, 105), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(at(q, 9) @ at(k, 5), at(q, 9) @ at(k, 6))
