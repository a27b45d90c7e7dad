"""The params schema: one class per section of params.yaml and what lies in it, each named
<Thing>Params (the model's own settings, which checkpoints record, are model/config.py's
*Config). Unknown keys, wrong types and impossible values fail validation; what ties sections
together is checked by checks.py."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveInt, ValidationError, field_validator, model_validator

from ..model.config import (
    ATTENTION_BACKENDS,
    FoxConfig,
    LearnedPositions,
    ModelConfig,
    RopeConfig,
    SeqPEConfig,
    Shape,
    head_dim_refused,
)
from .base import Strict
from .checks import consistent
from .data_params import CorporaParams, PackParams, TokenizeParams
from .eval_params import EvalParams, RopeSearchParams
from .train_params import TrainParams

# ---------------------------------------------------------------- model


class ModelParams(Strict, Shape):
    """The model the `base` stage trains: its Shape (model/config.py, shared with every
    checkpoint's ModelConfig) and how to build it (vocab_size comes from the tokenizer)."""

    arch: Literal["llama", "fox"] = "llama"
    max_position_embeddings: PositiveInt
    """The base model's context window (the original window L_train of RoPE scaling)."""
    rope_theta: float = Field(default=10000.0, gt=1)
    fox: FoxConfig = FoxConfig()
    """FoX (Pro) components, used when arch is fox."""
    position: Literal["rope", "learned", "alibi", "seqpe", "none"] | None = None
    """The position encoding; null: the arch's own (llama: rope, fox: none)."""
    learned_positions: LearnedPositions = LearnedPositions()
    """The learned table's settings, used when position is learned."""
    seqpe: SeqPEConfig = SeqPEConfig()
    """SeqPE's encoder, used when position is seqpe."""
    attention_backend: str = "auto"
    """A backend of model/attention.py, or auto: the fastest that runs here."""

    @field_validator("attention_backend")
    @classmethod
    def _known_backend(cls, value: str) -> str:
        if value != "auto" and value not in ATTENTION_BACKENDS:
            raise ValueError(f"attention backend {value!r} is unknown (known: {['auto', *ATTENTION_BACKENDS]})")
        return value

    def as_model_config(self, vocab_size: int) -> ModelConfig:
        """The ModelConfig a base model is built from: the Shape as it is, the position encoding
        (`position`, else the arch's own) and the FoX components its arch asks for."""
        position = self.position or ("none" if self.arch == "fox" else "rope")
        return ModelConfig(vocab_size=vocab_size, **self.model_dump(include=set(Shape.model_fields)),
                           rope=RopeConfig(theta=self.rope_theta) if position == "rope" else None,
                           learned_positions=self.learned_positions if position == "learned" else None,
                           alibi=position == "alibi", seqpe=self.seqpe if position == "seqpe" else None,
                           fox=self.fox if self.arch == "fox" else None)

    @model_validator(mode="after")
    def _positions(self) -> ModelParams:
        if self.position == "seqpe" and 10**self.seqpe.digits <= self.max_position_embeddings - 1:
            top = self.max_position_embeddings - 1
            raise ValueError(f"seqpe.digits {self.seqpe.digits} cannot write position {top} of the window "
                             f"max_position_embeddings {self.max_position_embeddings}")
        if self.position == "alibi" and self.arch == "fox":
            raise ValueError("position alibi is a fixed forget gate: a FoX model has its own (use arch llama)")
        try:
            cfg = self.as_model_config(vocab_size=1)  # the model it builds, checked now, not at build time
        except ValidationError as e:
            raise ValueError("; ".join(err["msg"].removeprefix("Value error, ") for err in e.errors())) from None
        if self.attention_backend != "auto" and (why := head_dim_refused(self.attention_backend, cfg.dim_head)):
            raise ValueError(f"attention backend {self.attention_backend!r} {why}; the model's heads have "
                             f"{cfg.dim_head} (head_dim, or d_model / n_heads)")
        return self


# ---------------------------------------------------------------- tracking


class TrackingParams(Strict):
    enabled: bool = True
    uri: str | None = None
    """MLflow tracking URI; default: SQLite at <project>/mlflow.db. Env MLFLOW_TRACKING_URI wins."""
    experiment: str = "longctx"
    unreachable: Literal["error", "local"] = "error"
    """A tracking server (http/https) that does not answer: stop before any work (error), or
    record the run in the project's local store instead, saying so (local)."""


# ---------------------------------------------------------------- the whole


class Params(Strict):
    profile: str
    corpora: CorporaParams
    tokenize: TokenizeParams
    pack: PackParams
    model: ModelParams
    train: TrainParams
    rope_search: RopeSearchParams = RopeSearchParams()
    eval: EvalParams = EvalParams()
    tracking: TrackingParams = TrackingParams()

    @model_validator(mode="after")
    def _consistent(self) -> Params:
        consistent(self)
        return self

    def flat_mix(self, split: str) -> dict[str, float]:
        """The split's mix with groups expanded: domain -> share of the split's tokens."""
        out: dict[str, float] = {}
        for name, share in self.pack.splits[split].mix.items():
            if name in self.pack.groups:
                for d, sub in self.pack.groups[name].items():
                    out[d] = out.get(d, 0.0) + share * sub
            elif name in self.corpora.domains:
                out[name] = out.get(name, 0.0) + share
            else:
                raise ValueError(f"pack.splits.{split}.mix.{name}: no such domain or group")
        return out

    def chunk_lengths(self, split: str, domain: str) -> dict[int, float]:
        """Chunk length -> share of the domain's tokens in this split."""
        spec = self.pack.splits[split]
        return spec.lengths.get(domain) or {spec.base_len: 1.0}
