"""Rotary position embeddings and the scaling family used to extend them.

Every scaling type returns (inverse frequencies, attention factor) for a head dimension, and
must agree with Hugging Face transformers for the same config (so checkpoints move between the
two without changing a logit). Layout is HF's: the rotation pairs dimension i with i + d/2.

Types:
  default   theta^(-2i/d); ProLong's base-frequency change is this with a larger theta
  linear    position interpolation (PI): frequencies / factor
  dynamic   NTK-aware: theta grows with the current length past the original window
  yarn      NTK-by-parts: interpolate low frequencies, keep high ones, ramp between
  llama3    Llama-3.1's wavelength-banded variant of the above
  longrope  per-dimension factors (LongRoPE / LongRoPE2): short factors inside the original
            window, long factors once the current length exceeds it
"""

from __future__ import annotations

import math

import torch

from .config import RopeConfig
from .transfer import to_device


def _base_exponents(dim: int) -> torch.Tensor:
    return torch.arange(0, dim, 2, dtype=torch.int64).float() / dim


def inverse_frequencies(cfg: RopeConfig, head_dim: int, max_position_embeddings: int,
                        seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim/2] float32, attention factor) for the current sequence length."""
    dim = head_dim
    expo = _base_exponents(dim)
    if cfg.type == "longrope" and len(cfg.short_factor) != dim // 2:
        raise ValueError(f"rope.short_factor has {len(cfg.short_factor)} values, head_dim {dim} needs {dim // 2}")
    if cfg.type == "longrope" and len(cfg.long_factor) != dim // 2:
        raise ValueError(f"rope.long_factor has {len(cfg.long_factor)} values, head_dim {dim} needs {dim // 2}")

    if cfg.type == "default":
        return 1.0 / cfg.theta**expo, 1.0
    if cfg.type == "linear":
        return 1.0 / cfg.theta**expo / cfg.factor, 1.0
    if cfg.type == "dynamic":
        length = max(seq_len or max_position_embeddings, max_position_embeddings)
        stretch = cfg.factor * length / max_position_embeddings - (cfg.factor - 1)
        theta = cfg.theta * stretch ** (dim / (dim - 2))
        return 1.0 / theta**expo, 1.0
    if cfg.type == "yarn":
        return _yarn(cfg, dim, max_position_embeddings)
    if cfg.type == "llama3":
        return _llama3(cfg, dim), 1.0
    return _longrope(cfg, dim, max_position_embeddings, seq_len)


def _yarn(cfg: RopeConfig, dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    original = cfg.original_max_position_embeddings
    factor = cfg.factor if cfg.factor is not None else max_position_embeddings / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = cfg.attention_factor
    if attention is None:
        if cfg.mscale and cfg.mscale_all_dim:
            attention = mscale(factor, cfg.mscale) / mscale(factor, cfg.mscale_all_dim)
        else:
            attention = mscale(factor)

    def dim_of(rotations: float) -> float:
        """The dimension whose wavelength fits `rotations` times in the original window."""
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(cfg.theta))

    low, high = dim_of(cfg.beta_fast), dim_of(cfg.beta_slow)
    if cfg.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (unchanged frequency), 0: interpolate (divide by factor)
    pos = cfg.theta ** torch.arange(0, dim, 2).float().div(dim)
    inv = (1.0 / (factor * pos)) * (1 - keep) + (1.0 / pos) * keep
    return inv, float(attention)


def _llama3(cfg: RopeConfig, dim: int) -> torch.Tensor:
    inv = 1.0 / cfg.theta ** _base_exponents(dim)
    window = cfg.original_max_position_embeddings
    long_wave, short_wave = window / cfg.low_freq_factor, window / cfg.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > long_wave, inv / cfg.factor, inv)
    smooth = (window / wavelen - cfg.low_freq_factor) / (cfg.high_freq_factor - cfg.low_freq_factor)
    blended = (1 - smooth) * scaled / cfg.factor + smooth * scaled
    middle = (wavelen >= short_wave) & (wavelen <= long_wave)
    return torch.where(middle, blended, scaled)


def _longrope(cfg: RopeConfig, dim: int, max_position_embeddings: int,
              seq_len: int | None) -> tuple[torch.Tensor, float]:
    original = cfg.original_max_position_embeddings
    factor = cfg.factor if cfg.factor is not None else max_position_embeddings / original
    attention = cfg.attention_factor
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    long = seq_len is not None and seq_len > original
    ext = torch.tensor(cfg.long_factor if long else cfg.short_factor, dtype=torch.float32)
    return 1.0 / (ext * cfg.theta ** _base_exponents(dim)), float(attention)


def depends_on_length(cfg: RopeConfig) -> bool:
    """Whether the frequencies change with the current sequence length."""
    return cfg.type in ("dynamic", "longrope")


def cos_sin(inv_freq: torch.Tensor, attention_factor: float, position_ids: torch.Tensor,
            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [..., T, head_dim] for integer positions, computed in fp32. `inv_freq` is
    [head_dim/2], or [T, head_dim/2] for frequencies that differ per token."""
    angles = position_ids.float()[..., None] * to_device(inv_freq, position_ids.device)
    emb = torch.cat((angles, angles), dim=-1)
    return (emb.cos() * attention_factor).to(dtype), (emb.sin() * attention_factor).to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply the rotation to x [..., T, head_dim] (HF's rotate-half layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


HF_KEYS = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
             "mscale", "mscale_all_dim", "truncate"),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings", "factor", "attention_factor"),
}
"""The fields HF transformers' `rope_parameters` carries per RoPE type (besides type and theta)."""


def hf_rope_parameters(cfg: RopeConfig) -> dict:
    """The `rope_parameters` / `rope_scaling` dict HF transformers reads for this config (also the
    form of rope_search's factors.json)."""
    out: dict = {"rope_type": cfg.type, "rope_theta": cfg.theta}
    for k in HF_KEYS.get(cfg.type, ()):
        v = getattr(cfg, k)
        if v is not None:
            out[k] = v
    return out


def from_hf(params: dict | None, theta: float | None = None) -> RopeConfig:
    """RopeConfig from an HF config's rope_parameters / rope_scaling (+ rope_theta)."""
    params = dict(params or {})
    kind = params.pop("rope_type", params.pop("type", "default"))
    theta = params.pop("rope_theta", theta if theta is not None else 10000.0)
    params.pop("partial_rotary_factor", None)
    fields = set(RopeConfig.model_fields)
    unknown = set(params) - fields
    if unknown:
        raise ValueError(f"rope parameters {sorted(unknown)} are not supported")
    return RopeConfig(type=kind, theta=theta, **params)
