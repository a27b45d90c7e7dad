"""Typed, validated params.

A run's params are a named profile (``src/longctx/profiles/<name>.yaml``) with the sections of
``params.yaml`` merged over it key by key (a ``null`` drops a key). Everything is validated
before any work starts: unknown keys, wrong types and impossible values are errors that name
the dotted key.
"""

from __future__ import annotations

import math
from importlib import resources
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)

from .errors import ConfigError
from .model.config import FoxConfig, Recompute

SUM_TOLERANCE = 1e-6


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# ---------------------------------------------------------------- corpora

BuiltinName = Literal["stdlib_repos", "stdlib_books", "stdlib_short", "stdlib_sft"]


class SourceSpec(Strict):
    """Where one stream of documents comes from: exactly one of path, hub, builtin."""

    path: str | None = None
    """Local file or directory of .txt/.md (one document per file), .jsonl or .parquet."""
    hub: str | None = None
    """A `datasets` hub id (or a local dataset directory), read with streaming."""
    builtin: BuiltinName | None = None
    """Real text every Python install has (the offline `tiny` profile)."""
    name: str | None = None
    split: str = "train"
    text_field: str = "text"
    messages_field: str = "messages"
    """Column with UltraChat-style messages: kept for sft domains, rendered as text otherwise."""
    filter: dict[str, str] = Field(default_factory=dict)
    """Hub rows are kept only where each dotted field equals the value."""
    group_by: str | None = None
    """Concatenate consecutive rows sharing this field into one document (repo-level code)."""
    header_field: str | None = None
    """With group_by: a field (e.g. the file path) written as a header before each row."""
    part: str | None = None
    """Builtin only: which slice of the builtin text (e.g. stdlib_short: docstrings|modules|topics)."""
    max_docs: PositiveInt | None = None
    max_bytes: PositiveInt | None = None
    site_packages: bool = False
    """stdlib_repos: also read installed third-party packages as repositories."""

    @model_validator(mode="after")
    def _one_origin(self) -> SourceSpec:
        given = [k for k in ("path", "hub", "builtin") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of path, hub, builtin (got {given or 'none'})")
        if self.header_field and not self.group_by:
            raise ValueError("header_field needs group_by")
        if self.hub is None and (self.filter or self.group_by or self.name):
            raise ValueError("filter, group_by and name apply to hub sources only")
        if self.builtin is None and (self.part or self.site_packages):
            raise ValueError("part and site_packages apply to builtin sources only")
        return self


class DomainSpec(Strict):
    kind: Literal["long", "short", "sft"]
    """long: filtered by length and cut into single-document chunks; short: packed with
    carry-over; sft: conversations packed with an assistant-only loss mask."""
    sources: list[SourceSpec] = Field(min_length=1)


class CorporaConfig(Strict):
    seed: int = 0
    invalid_utf8: Literal["replace", "reject"] = "replace"
    """Local files with bytes that are not UTF-8: replace them with U+FFFD (counted in the
    manifest) or reject the file."""
    domains: dict[str, DomainSpec] = Field(min_length=1)


# ---------------------------------------------------------------- tokenize


class TrainBPE(Strict):
    vocab_size: int = Field(ge=300, le=1 << 20)
    min_frequency: PositiveInt = 2
    sample_bytes: PositiveInt = 20_000_000
    """Bytes of text (spread over domains) the tokenizer is trained on."""


class TokenizerSpec(Strict):
    path: str | None = None
    """A tokenizer directory (tokenizer.json [+ tokenizer_config.json]) or a hub model id."""
    train: TrainBPE | None = None
    """Train a byte-level BPE on the corpus instead."""
    chat_template: str | None = None
    """Jinja chat template; overrides the tokenizer's own."""

    @model_validator(mode="after")
    def _one(self) -> TokenizerSpec:
        if (self.path is None) == (self.train is None):
            raise ValueError("give exactly one of path, train")
        return self


class TokenizeConfig(Strict):
    tokenizer: TokenizerSpec
    dtype: Literal["auto", "uint16", "uint32"] = "auto"
    add_bos: bool = True
    add_eos: bool = True
    long_min_tokens: PositiveInt
    """Documents of long-data domains shorter than this are dropped."""
    batch_size: PositiveInt = 512
    num_workers: NonNegativeInt = 2
    """Encoding processes; 0 encodes in the stage's own process."""
    shard_tokens: PositiveInt = 1 << 28


# ---------------------------------------------------------------- pack


class SplitSpec(Strict):
    seq_len: PositiveInt
    chunk_len: PositiveInt | None = None
    """Length at which short and SFT data are packed and long documents are cut, unless
    `lengths` says otherwise; several chunks fill one sequence. Default: seq_len."""
    tokens: PositiveInt | None = None
    """Training tokens; null takes as many as the data allows at the requested mix."""
    mix: dict[str, float] = Field(min_length=1)
    """Domain or group name -> share of tokens."""
    lengths: dict[str, dict[int, float]] = Field(default_factory=dict)
    """Long domain -> {chunk length: share of that domain's tokens} (ProLong's stage 2)."""

    @property
    def base_len(self) -> int:
        return self.chunk_len or self.seq_len


class PackConfig(Strict):
    seed: int = 0
    val_fraction: float = Field(default=0.05, gt=0, lt=1)
    """Share of each domain's documents held out (chosen by a hash of the document id)."""
    tolerance: float = Field(default=0.05, gt=0, lt=1)
    """Largest allowed gap between achieved and requested share of any domain."""
    groups: dict[str, dict[str, float]] = Field(default_factory=dict)
    """Named sub-mixes (ProLong's ShortMix): group -> {domain: share}."""
    splits: dict[str, SplitSpec] = Field(min_length=1)


# ---------------------------------------------------------------- model and training


class ModelParams(Strict):
    """The model the `base` stage trains (vocab_size comes from the tokenizer)."""

    arch: Literal["llama", "fox"] = "llama"
    d_model: PositiveInt
    n_layers: PositiveInt
    n_heads: PositiveInt
    n_kv_heads: PositiveInt | None = None
    ffn_dim: PositiveInt
    max_position_embeddings: PositiveInt
    """The base model's context window (the original window L_train of RoPE scaling)."""
    rope_theta: float = Field(default=10000.0, gt=1)
    fox: FoxConfig = FoxConfig()
    """FoX (Pro) components, used when arch is fox."""
    tie_embeddings: bool = False
    attention_backend: str = "auto"


class TrainConfig(Strict):
    """One run of the training loop."""

    steps: PositiveInt
    micro_batch: PositiveInt = 1
    """Packed sequences per micro-batch."""
    grad_accum: PositiveInt = 1
    lr: float = Field(gt=0)
    lr_min: float = Field(default=0.0, ge=0)
    warmup: float = Field(default=0.1, ge=0, le=1)
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = Field(default=0.1, ge=0)
    clip: float = Field(default=1.0, gt=0)
    seed: int = 0
    checkpoint_every: PositiveInt = 100
    keep_last: PositiveInt = 2
    loss_chunk: PositiveInt = 2048
    activation_checkpointing: Recompute = "none"
    """Per block: none, full (recompute the block in the backward) or selective (keep matmul and
    attention outputs, recompute the elementwise work)."""
    compile: bool = True
    """torch.compile each block and the loss on CUDA (CPU runs stay eager)."""
    offload: bool = False
    """FSDP2 CPU offload of parameters, gradients and optimizer state (GPU runs; the optimizer
    then steps on the CPU): for sequences too long for the GPU otherwise."""
    acp_eps: float | None = Field(default=None, gt=0, lt=1)
    """Adaptive Computation Pruning of FoX attention: skip tiles whose entries each carry under
    eps / L of their row (the paper's e^-10 = 4.54e-5). Needs the 'fox' attention backend
    (CUDA); the pruned fraction is logged per step. None: off."""
    sequence_parallel: PositiveInt = 1
    """Ranks that share each sequence (Ulysses); must divide the world size and the heads."""


class TrainStage(TrainConfig):
    split: str
    """The packed split (pack.splits) it trains on."""
    val_sequences: PositiveInt = 64
    """Validation sequences scored at the end."""


class PretrainStage(TrainStage):
    rope_theta: float | None = Field(default=None, gt=1)
    """RoPE base for this stage (ProLong: 8e6 at 64K, 1.28e8 at 512K); null keeps the model's."""


class PretrainParams(Strict):
    init: str = "base"
    """"base" (the base stage's model) or an HF checkpoint directory."""
    factors: str | None = None
    """A LongRoPE factors JSON (HF longrope form), or "search" for the rope_search stage's output.
    Replaces the base change; documents within the original window keep the original RoPE (mixed
    context window)."""
    stages: list[PretrainStage] = Field(min_length=1)


class TrainParams(Strict):
    base: TrainStage | None = None
    """Short-context training of a base model from scratch; null when pretrain starts from a
    pretrained checkpoint."""
    pretrain: PretrainParams
    sft: TrainStage
    nproc: PositiveInt | Literal["auto"] = 1
    """Training processes on this machine (torchrun, one per GPU); "auto": one per visible GPU.
    Not a recipe parameter: the global batch is the same for any count."""


# ---------------------------------------------------------------- rope_search


class RopeSearchConfig(Strict):
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
    any up to the last (for models whose critical frequencies sit above the theory)."""
    search_attention: bool = False
    """Also try attention factor 1.0 beside LongRoPE2's sqrt(1 + ln s / ln L_train)."""
    seed: int = 0
    max_evaluations: PositiveInt | None = None
    max_seconds: float | None = Field(default=None, gt=0)
    batch_tokens: PositiveInt = 32768
    """Tokens per forward when scoring."""


# ---------------------------------------------------------------- eval


class HelmetSource(Strict):
    """One HELMET dataset: its kind, where its rows are (hub id, directory or JSON/JSONL file)."""

    kind: Literal["icl", "rag", "rerank", "narrativeqa", "summ"]
    path: str
    split: str = "test"
    fields: dict[str, str] = {}
    """Our field name -> the dataset's, e.g. {label: coarse_label} for TREC."""
    limit: PositiveInt | None = 2000
    """Rows read (ICL demonstrations are drawn from them)."""


class EvalConfig(Strict):
    """The `eval` stage: every checkpoint the pipeline made, the same prompts for all."""

    TASKS: ClassVar[tuple[str, ...]] = (
        "niah_single_noise", "niah_single_text", "niah_multikey", "niah_multivalue", "niah_multiquery",
        "variable_tracking", "common_words", "frequent_words", "passkey", "json_kv", "icl")
    """The known task names, in eval.tasks.BUILDERS' order (it checks so on import): listed here
    because config imports no eval code."""
    tasks: list[str] = list(TASKS)
    lengths: list[PositiveInt] = [8192, 16384, 32768, 65536, 131072]
    """Context lengths of the task prompts (tokens)."""
    samples: PositiveInt = 4
    """Prompts per task and length (the single-needle noise task: one per depth)."""
    depths: list[float] = [0.0, 0.25, 0.5, 0.75, 1.0]
    seed: int = 0
    backend: Literal["ours", "transformers"] = "ours"
    """Greedy decoding with our KV cache, or with transformers on the HF export (RoPE models)."""
    position_sequences: PositiveInt = 8
    """Long validation documents for the per-position loss and perplexity against length."""
    needle_sequences: PositiveInt = 8
    retention_sequences: PositiveInt = 32
    """Short validation sequences for short-context perplexity."""
    retention_split: str | None = None
    """Packed split whose validation part measures retention; default the base split if any."""
    helmet: dict[str, HelmetSource] = {}
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


# ---------------------------------------------------------------- tracking


class TrackingConfig(Strict):
    enabled: bool = True
    uri: str | None = None
    """MLflow tracking URI; default: SQLite at <project>/mlflow.db. Env MLFLOW_TRACKING_URI wins."""
    experiment: str = "longctx"


# ---------------------------------------------------------------- the whole


class Config(Strict):
    profile: str
    corpora: CorporaConfig
    tokenize: TokenizeConfig
    pack: PackConfig
    model: ModelParams
    train: TrainParams
    rope_search: RopeSearchConfig = RopeSearchConfig()
    eval: EvalConfig = EvalConfig()
    tracking: TrackingConfig = TrackingConfig()

    @model_validator(mode="after")
    def _consistent(self) -> Config:
        domains = self.corpora.domains
        for g, sub in self.pack.groups.items():
            if g in domains:
                raise ValueError(f"pack.groups.{g}: name is also a corpora domain")
            _check_shares(f"pack.groups.{g}", sub)
            for d in sub:
                if d not in domains:
                    raise ValueError(f"pack.groups.{g}.{d}: no such corpora domain")
        for name, split in self.pack.splits.items():
            where = f"pack.splits.{name}"
            _check_shares(f"{where}.mix", split.mix)
            base = split.base_len
            if base > split.seq_len or split.seq_len % base:
                raise ValueError(f"{where}.chunk_len: {base} must divide seq_len {split.seq_len}")
            mix = self.flat_mix(name)
            kinds = {domains[d].kind for d in mix}
            if "sft" in kinds and len(kinds) > 1:
                raise ValueError(f"{where}.mix: sft domains cannot be mixed with {kinds - {'sft'}}")
            for d, shares in split.lengths.items():
                if d not in mix:
                    raise ValueError(f"{where}.lengths.{d}: not in this split's mix")
                if domains[d].kind != "long":
                    raise ValueError(f"{where}.lengths.{d}: only long domains take lengths")
                _check_shares(f"{where}.lengths.{d}", shares)
                for length in shares:
                    if length <= 0 or length > split.seq_len or split.seq_len % length:
                        raise ValueError(
                            f"{where}.lengths.{d}.{length}: must be positive and divide "
                            f"seq_len {split.seq_len}"
                        )
            for d in mix:
                if domains[d].kind == "long":
                    shortest = min(self.chunk_lengths(name, d))
                    if self.tokenize.long_min_tokens > shortest:
                        raise ValueError(
                            f"tokenize.long_min_tokens: {self.tokenize.long_min_tokens} is above "
                            f"the chunk length {shortest} of long domain {d} in {where}"
                        )
        if self.train.base is None and self.train.pretrain.init == "base":
            raise ValueError("train.pretrain.init: 'base' needs a train.base section (or give a checkpoint dir)")
        stages = [("train.sft", self.train.sft)] + ([("train.base", self.train.base)] if self.train.base else [])
        stages += [(f"train.pretrain.stages.{i}", st) for i, st in enumerate(self.train.pretrain.stages)]
        for where, stage in stages:
            if stage.split not in self.pack.splits:
                raise ValueError(f"{where}.split: {stage.split!r} is not a pack split ({sorted(self.pack.splits)})")
        if self.eval.retention_split is not None and self.eval.retention_split not in self.pack.splits:
            raise ValueError(f"eval.retention_split: {self.eval.retention_split!r} is not a pack split "
                             f"({sorted(self.pack.splits)})")
        rs = self.rope_search
        if rs.split is not None and rs.split not in self.pack.splits:
            raise ValueError(f"rope_search.split: {rs.split!r} is not a pack split ({sorted(self.pack.splits)})")
        if rs.target_length and rs.original_window and rs.target_length <= rs.original_window:
            raise ValueError(f"rope_search.target_length: {rs.target_length} must exceed the original window "
                             f"{rs.original_window}")
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


def _check_shares(where: str, shares: dict[Any, float]) -> None:
    if not shares:
        raise ValueError(f"{where}: empty")
    for k, v in shares.items():
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ValueError(f"{where}.{k}: share must be a positive number, got {v!r}")
    total = sum(shares.values())
    if abs(total - 1.0) > SUM_TOLERANCE:
        raise ValueError(f"{where}: shares sum to {total:.6g}, must sum to 1")


# ---------------------------------------------------------------- loading


def profile_path(name: str) -> Path:
    return Path(str(resources.files("longctx") / "profiles" / f"{name}.yaml"))


def available_profiles() -> list[str]:
    folder = Path(str(resources.files("longctx") / "profiles"))
    return sorted(p.stem for p in folder.glob("*.yaml"))


def merge(base: dict, over: dict) -> dict:
    """Deep-merge `over` into a copy of `base`; dicts merge, other values replace, None drops, an
    empty dict changes nothing. Keys match by their text, so a YAML `"8192"` overrides a
    profile's `8192`."""
    out = dict(base)
    for k, v in over.items():
        k = next((b for b in out if str(b) == str(k)), k)
        if v == {}:
            continue
        if v is None:
            out.pop(k, None)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


def _read_yaml(path: Path, what: str) -> dict:
    if not path.is_file():
        raise ConfigError(f"{path}: {what} not found")
    try:
        data = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: must be a mapping of sections, got {type(data).__name__}")
    return data


def resolve(overrides: dict, source: str = "params") -> Config:
    """Profile + overrides -> validated Config. `source` names the overrides in errors."""
    profile = overrides.get("profile", "tiny")
    if not isinstance(profile, str) or profile not in available_profiles():
        raise ConfigError(
            f"{source}: profile: unknown profile {profile!r}; choose one of {available_profiles()}"
        )
    raw = merge(_read_yaml(profile_path(profile), f"profile {profile}"), overrides)
    raw["profile"] = profile
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(f"{source}: " + _describe(e)) from None


def load(path: str | Path = "params.yaml") -> Config:
    path = Path(path)
    return resolve(_read_yaml(path, "params file"), source=str(path))


def _describe(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        key = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-after"))
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        lines.append(f"{key}: {msg}" if key else msg)
    return "; ".join(lines)


def flat(config: BaseModel, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> scalar, for experiment trackers."""
    out: dict[str, Any] = {}

    def walk(obj: Any, key: str) -> None:
        if isinstance(obj, BaseModel):
            obj = obj.model_dump()
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{key}.{k}" if key else str(k))
        elif isinstance(obj, list):
            for i, v in enumerate(obj):
                walk(v, f"{key}.{i}")
        else:
            out[key] = obj

    walk(config, prefix)
    return out


def main() -> None:
    """`python -m longctx.config [params.yaml]`: print the params in force, profile merged in."""
    import sys

    path = sys.argv[1] if len(sys.argv) > 1 else "params.yaml"
    try:
        cfg = load(path)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(yaml.safe_dump(cfg.model_dump(mode="json", exclude_none=True), sort_keys=False), end="")


if __name__ == "__main__":
    main()
