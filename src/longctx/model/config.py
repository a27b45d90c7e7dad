"""Model shapes: a Llama-style decoder, optionally a Forgetting Transformer (FoX), and its
position encoding. Plain pydantic (no torch), so params can be validated before any import."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

RopeType = Literal["default", "linear", "dynamic", "yarn", "llama3", "longrope"]
ATTENTION_BACKENDS = ("reference", "sdpa", "cudnn", "flash_attn", "varlen", "flex", "fox")
"""The attention backends by name (model/attention.py implements them and checks this list)."""


def head_dim_refused(backend: str, head_dim: int) -> str | None:
    """Why `backend`'s kernel cannot take heads of `head_dim`, or None."""
    if backend in ("cudnn", "flash_attn", "varlen") and (head_dim > 256 or head_dim % 8):
        return "takes head_dim <= 256 and a multiple of 8"
    if backend == "fox" and (head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1)):
        return "takes a power-of-two head_dim from 16 to 256"
    return None


Recompute = Literal["none", "full", "halves", "selective", "attention"]
"""Activation checkpointing of a block (model/recompute.py)."""


Factor = Annotated[float, Field(gt=0, allow_inf_nan=False)]
"""A LongRoPE rescale factor: a positive, finite number."""


class RopeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    type: RopeType = "default"
    theta: float = Field(default=10000.0, gt=1)
    factor: float | None = Field(default=None, gt=0)
    original_max_position_embeddings: int | None = Field(default=None, gt=0)
    attention_factor: float | None = Field(default=None, gt=0)
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    # longrope
    short_factor: list[Factor] | None = None
    long_factor: list[Factor] | None = None

    @model_validator(mode="after")
    def _needs(self) -> RopeConfig:
        need = {
            "linear": ("factor",),
            "dynamic": ("factor",),
            "yarn": ("original_max_position_embeddings",),
            "llama3": ("factor", "original_max_position_embeddings"),
            "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
        }.get(self.type, ())
        missing = [k for k in need if getattr(self, k) is None]
        if missing:
            raise ValueError(f"rope type {self.type!r} needs {missing}")
        return self




class FoxConfig(BaseModel):
    """The forget gate is always on; the FoX (Pro) components switch for ablations
    (all on: FoX (Pro); all off: FoX (LLaMA))."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    qk_norm: bool = True
    output_gate: bool = True
    output_norm: bool = True
    kv_shift: bool = True


class LearnedPositions(BaseModel):
    """A learned absolute position table of max_position_embeddings rows, added to the token
    embeddings (GPT-2's APE). A position past the table is an error, or the last row (clamp)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    beyond: Literal["error", "clamp"] = "error"


class SeqPEConfig(BaseModel):
    """SeqPE ("Transformer with Sequential Position Encoding", 2025): each position's decimal digits,
    left-padded to `digits`, read by a small causal Transformer (`layers` x `heads`, width `dim`);
    its last state, projected and divided by
    `temperature`, is the position's embedding, turned into per-head query and key parts whose
    product biases the attention logits (the paper's text models). Positions past 10^digits - 1:
    an error, or the largest (clamp)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    digits: int = Field(default=5, gt=0, le=18)
    dim: int = Field(default=256, gt=0)
    layers: int = Field(default=2, gt=0)
    heads: int = Field(default=4, gt=0)
    temperature: float = Field(default=1.0, gt=0)
    beyond: Literal["error", "clamp"] = "error"

    @model_validator(mode="after")
    def _heads(self) -> SeqPEConfig:
        if self.dim % self.heads:
            raise ValueError(f"seqpe.dim {self.dim} is not divisible by seqpe.heads {self.heads}")
        return self


class Shape(BaseModel):
    """A decoder's dimensions: what params give for a model trained from scratch (config's
    ModelParams) and what every checkpoint records (ModelConfig)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    d_model: int = Field(gt=0)
    n_layers: int = Field(gt=0)
    n_heads: int = Field(gt=0)
    n_kv_heads: int | None = Field(default=None, gt=0)
    ffn_dim: int = Field(gt=0)
    max_position_embeddings: int = Field(default=4096, gt=0)
    """The context window (for a base model, the original window L_train of RoPE scaling)."""
    tie_embeddings: bool = False


class ModelConfig(Shape):
    vocab_size: int = Field(gt=0)
    head_dim: int | None = Field(default=None, gt=0)
    norm_eps: float = Field(default=1e-5, gt=0)
    attention_bias: bool = False
    """Biases on q, k, v projections (Qwen2's layout; o has none)."""
    hf_architecture: Literal["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"] = "LlamaForCausalLM"
    """The HF architecture the model is exported as: an imported checkpoint's own."""
    rope: RopeConfig | None = RopeConfig()
    """None: no position encoding (FoX's forget gate carries position)."""
    fox: FoxConfig | None = None
    learned_positions: LearnedPositions | None = None
    alibi: bool = False
    """ALiBi: a per-head linear penalty on distance, as a FoX decay with fixed gates."""
    seqpe: SeqPEConfig | None = None
    reset_position_ids: bool = True
    """RoPE positions restart at every document of a packed sequence."""
    init_std: float = Field(default=0.02, gt=0)

    @model_validator(mode="after")
    def _shapes(self) -> ModelConfig:
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}; set head_dim")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads {self.n_heads} must be a multiple of n_kv_heads {self.kv_heads}")
        if self.attention_bias and self.hf_architecture != "Qwen2ForCausalLM":
            raise ValueError(f"attention_bias (on q, k, v alone) is Qwen2's layout, not {self.hf_architecture}'s")
        if (self.head_dim or self.d_model // self.n_heads) % 2 and self.rope is not None:
            raise ValueError("RoPE needs an even head_dim")
        chosen = [name for name in ("rope", "learned_positions", "seqpe") if getattr(self, name) is not None]
        chosen += ["alibi"] if self.alibi else []
        if len(chosen) > 1:
            raise ValueError(f"one position encoding at a time, got {chosen}")
        if self.alibi and self.fox is not None:
            raise ValueError("alibi is a fixed forget gate: a FoX model has its own")
        if self.seqpe is not None and 10**self.seqpe.digits <= self.max_position_embeddings - 1:
            raise ValueError(f"seqpe.digits {self.seqpe.digits} cannot write position "
                             f"{self.max_position_embeddings - 1} of the window {self.max_position_embeddings}")
        return self

    @property
    def position(self) -> str:
        """The position encoding by name: rope, learned, alibi, seqpe or none."""
        if self.rope is not None:
            return "rope"
        if self.learned_positions is not None:
            return "learned"
        return "alibi" if self.alibi else "seqpe" if self.seqpe is not None else "none"

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def dim_head(self) -> int:
        return self.head_dim or self.d_model // self.n_heads


PRESETS: dict[str, dict] = {
    # FoX paper shapes (Table 11 of the seed): heads of 64, SwiGLU, no RoPE for FoX.
    "fox-125m": dict(vocab_size=50277, d_model=768, n_layers=12, n_heads=12, ffn_dim=2048),
    "fox-360m": dict(vocab_size=50277, d_model=1024, n_layers=24, n_heads=16, ffn_dim=2816),
    "fox-760m": dict(vocab_size=50277, d_model=1536, n_layers=24, n_heads=24, ffn_dim=4096),
    "llama3-8b": dict(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                      max_position_embeddings=8192, rope=RopeConfig(theta=500000.0)),
    # for CPU runs of the benchmarks
    "tiny": dict(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128),
}
