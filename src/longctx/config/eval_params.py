"""The rope_search and eval sections of the params."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, PositiveInt, field_validator, model_validator

from .base import Strict

# ---------------------------------------------------------------- rope_search


class RopeSearchParams(Strict):
    """LongRoPE2's factor search (the `rope_search` stage), run on the model pretrain starts from."""

    enabled: bool = True
    """false: the stage records that it was skipped (FoX models have no RoPE and skip it too)."""
    target_length: PositiveInt | None = None
    """L, the length the factors are for; default 4 x the original window."""
    original_window: PositiveInt | None = None
    """L_train; default the model's max_position_embeddings."""
    split: str | None = None
    """Packed split whose validation part gives the long documents; default the split with the
    shortest sequences that still reach the target length."""
    sequences: PositiveInt = 8
    """Needle sequences the fitness is computed on."""
    table_sequences: PositiveInt = 16
    """Needle / plain sequences per length in the method table (other documents than the fitness')."""
    lengths: list[PositiveInt] = []
    """Extra lengths for the table besides the original window and the target."""
    needle_depth: float = Field(default=0.05, ge=0, le=0.5)
    """Where the needle goes, as a fraction of the haystack ("near the start")."""
    population: int = Field(default=64, ge=4)
    generations: int = Field(default=40, ge=0)
    mutation: float = Field(default=0.3, ge=0, le=1)
    crossover: float = Field(default=0.5, ge=0, le=1)
    keep: float = Field(default=0.5, gt=0, lt=1)
    factor_max: float = Field(default=2.0, ge=1)
    """Upper bound of searched factors, in units of s = target / original window."""
    critical_max: Literal["theory", "all"] = "theory"
    """Highest candidate for the real critical frequency: the theoretical one (the paper), or
    any up to the last (for models whose critical frequencies sit above the theory). The paper's
    by default: on a 33M model at 512 -> 2,048 the wider space (with `search_attention`) chose the
    theoretical index and the paper's factor anyway, and its setting tuned to a worse needle
    perplexity (bench/rope_methods.py, two seeds)."""
    search_attention: bool = False
    """Also try attention factor 1.0 beside LongRoPE2's sqrt(1 + ln s / ln L_train)."""
    seed: int = 0
    max_evaluations: PositiveInt | None = None
    max_seconds: float | None = Field(default=None, gt=0)
    batch_tokens: PositiveInt = 32768
    """Tokens per forward when scoring."""


# ---------------------------------------------------------------- eval


class HelmetParams(Strict):
    """One HELMET dataset: its kind, where its rows are (hub id, directory or JSON/JSONL file)."""

    kind: Literal["icl", "rag", "rerank", "narrativeqa", "summ"]
    path: str
    split: str = "test"
    fields: dict[str, str] = {}
    """Our field name -> the dataset's, e.g. {label: coarse_label} for TREC."""
    limit: PositiveInt | None = 2000
    """Rows read (ICL demonstrations are drawn from them)."""


class EvalParams(Strict):
    """The `eval` stage: every checkpoint the pipeline made, the same prompts for all."""

    TASKS: ClassVar[tuple[str, ...]] = (
        "niah_single_noise", "niah_single_text", "niah_multikey", "niah_multivalue", "niah_multiquery",
        "variable_tracking", "common_words", "frequent_words", "passkey", "json_kv", "icl")
    """The known task names, in eval.tasks.BUILDERS' order (it checks so on import): listed here
    because config imports no eval code."""
    tasks: list[str] = Field(default=list(TASKS), min_length=1)
    lengths: list[PositiveInt] = Field(default=[8192, 16384, 32768, 65536, 131072], min_length=1)
    """Context lengths of the task prompts (tokens)."""
    samples: PositiveInt = 4
    """Prompts per task and length (the single-needle noise task: at least one per depth)."""
    samples_by_checkpoint: dict[str, PositiveInt] = {}
    """Fewer prompts for some checkpoints (name -> prompts a task and length, at most `samples`):
    each asks the first of every cell's prompts, so paired tests still pair them."""
    depths: list[float] = [0.0, 0.25, 0.5, 0.75, 1.0]
    seed: int = 0
    backend: Literal["ours", "transformers"] = "ours"
    """Greedy decoding with our KV cache, or with transformers on the HF export (RoPE models)."""
    batch_tokens: PositiveInt = 65536
    """Prompt tokens prefilled and decoded together (packed, each prompt masked from the others;
    ours only); a longer prompt goes alone. Bounds the eval's memory."""
    acp_eps: float | None = Field(default=None, gt=0, lt=1)
    """FoX checkpoints prefill their prompts and score their losses with Adaptive Computation
    Pruning at this threshold (each query drops attention weights summing under it; the
    training's e^-10 = 4.54e-5), as FoX + ACP trains; None: every weight (exact attention)."""
    position_sequences: PositiveInt = 8
    """Long validation documents for the per-position loss and perplexity against length."""
    needle_sequences: PositiveInt = 8
    retention_sequences: PositiveInt = 32
    """Short validation sequences for short-context perplexity."""
    retention_split: str | None = None
    """Packed split whose validation part measures retention; default the base split if any."""
    helmet: dict[str, HelmetParams] = {}
    """HELMET dataset categories by name (e.g. trec, banking77, nq, msmarco, narrativeqa)."""
    lm_eval_tasks: list[str] = []
    """lm-eval-harness tasks for short-context retention (real profiles: hellaswag, arc_challenge,
    winogrande, mmlu, gsm8k); their datasets must be reachable (hub cache or local)."""
    lm_eval_limit: PositiveInt | None = None
    """Examples per lm-eval task (None: all)."""

    @field_validator("tasks")
    @classmethod
    def _known(cls, value: list[str]) -> list[str]:
        unknown = [t for t in value if t not in cls.TASKS]
        if unknown:
            raise ValueError(f"unknown tasks {unknown} (known: {list(cls.TASKS)})")
        return value

    @field_validator("depths")
    @classmethod
    def _fractions(cls, value: list[float]) -> list[float]:
        if not value or any(not 0 <= d <= 1 for d in value):
            raise ValueError("depths must be fractions in [0, 1]")
        return value

    @model_validator(mode="after")
    def _fewer(self) -> EvalParams:
        more = {c: n for c, n in self.samples_by_checkpoint.items() if n > self.samples}
        if more:
            raise ValueError(f"samples_by_checkpoint {more}: more prompts than samples ({self.samples}) builds")
        return self
