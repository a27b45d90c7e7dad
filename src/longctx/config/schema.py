"""The params schema: one class per section of params.yaml and what lies in it, each named
<Thing>Params (the model's own settings, which checkpoints record, are model/config.py's
*Config). Unknown keys, wrong types and impossible values fail validation; what ties sections
together is checked by checks.py."""

from __future__ import annotations

from typing import ClassVar, Literal

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

from ..model.config import (
    ATTENTION_BACKENDS,
    FoxConfig,
    LearnedPositions,
    ModelConfig,
    Recompute,
    RopeConfig,
    SeqPEConfig,
    Shape,
    head_dim_refused,
)
from .checks import consistent


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# ---------------------------------------------------------------- corpora

BuiltinName = Literal["stdlib_repos", "stdlib_books", "stdlib_short", "stdlib_sft"]


class SyntheticParams(Strict):
    """Generated retrieval documents (data/synthetic.py), each ending with its question and
    answer; lengths log-uniform between the bounds, in characters (the tokenizer is trained
    after the corpora)."""

    formats: list[Literal["passkey", "kv", "multikey", "multiquery"]] = Field(
        default_factory=lambda: ["passkey", "kv", "multikey"], min_length=1)
    min_chars: PositiveInt = 1000
    max_chars: PositiveInt = 30000

    @model_validator(mode="after")
    def _ordered(self) -> SyntheticParams:
        if self.min_chars > self.max_chars:
            raise ValueError(f"min_chars {self.min_chars} is above max_chars {self.max_chars}")
        return self


class SourceParams(Strict):
    """Where one stream of documents comes from: exactly one of path, hub, builtin, synthetic."""

    path: str | None = None
    """Local file or directory of .txt/.md (one document per file), .jsonl or .parquet."""
    hub: str | None = None
    """A `datasets` hub id (or a local dataset directory), read with streaming."""
    builtin: BuiltinName | None = None
    """Real text every Python install has (the offline `tiny` profile)."""
    synthetic: SyntheticParams | None = None
    """Generated retrieval documents (needs max_docs or max_bytes: the stream does not end)."""
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
    doc_max_bytes: PositiveInt | None = None
    """Each text document cut to its first this many bytes: one huge document (site-packages'
    torch, ~90 MB) would otherwise hold up the tokenize stage alone. A repository's files are
    shuffled, so the cut keeps a random sample of them."""
    site_packages: bool = False
    """stdlib_repos: also read installed third-party packages as repositories."""

    @model_validator(mode="after")
    def _one_origin(self) -> SourceParams:
        given = [k for k in ("path", "hub", "builtin", "synthetic") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of path, hub, builtin, synthetic (got {given or 'none'})")
        if self.synthetic is not None and self.max_docs is None and self.max_bytes is None:
            raise ValueError("a synthetic source needs max_docs or max_bytes (it generates without end)")
        if self.header_field and not self.group_by:
            raise ValueError("header_field needs group_by")
        if self.hub is None and (self.filter or self.group_by or self.name):
            raise ValueError("filter, group_by and name apply to hub sources only")
        if self.builtin is None and (self.part or self.site_packages):
            raise ValueError("part and site_packages apply to builtin sources only")
        return self


class DomainParams(Strict):
    kind: Literal["long", "short", "whole", "sft"]
    """long: filtered by length and cut into single-document chunks; short: packed with
    carry-over; whole: packed without cutting a document across chunks (retrieval documents keep
    their questions with their needles); sft: conversations packed with an assistant-only loss
    mask."""
    sources: list[SourceParams] = Field(min_length=1)


class CorporaParams(Strict):
    seed: int = 0
    invalid_utf8: Literal["replace", "reject"] = "replace"
    """Local files with bytes that are not UTF-8: replace them with U+FFFD (counted in the
    manifest) or reject the file."""
    domains: dict[str, DomainParams] = Field(min_length=1)
    num_workers: NonNegativeInt = 1
    """Domains collected side by side in worker processes (1: one after another in the stage's
    process). The output does not depend on it: each domain's documents are seeded on their own."""


# ---------------------------------------------------------------- tokenize


class BPEParams(Strict):
    vocab_size: int = Field(ge=300, le=1 << 20)
    min_frequency: PositiveInt = 2
    sample_bytes: PositiveInt = 20_000_000
    """Bytes of text (spread over domains) the tokenizer is trained on."""
    split_digits: bool = False
    """Every digit its own token, as Llama's tokenizer has them: a BPE trained on retrieval
    documents otherwise learns thousands of digit groups, and a model must learn to copy each."""


class TokenizerParams(Strict):
    path: str | None = None
    """A tokenizer directory (tokenizer.json [+ tokenizer_config.json]) or a hub model id."""
    train: BPEParams | None = None
    """Train a byte-level BPE on the corpus instead."""
    chat_template: str | None = None
    """Jinja chat template; overrides the tokenizer's own."""

    @model_validator(mode="after")
    def _one(self) -> TokenizerParams:
        if (self.path is None) == (self.train is None):
            raise ValueError("give exactly one of path, train")
        return self


class TokenizeParams(Strict):
    tokenizer: TokenizerParams
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


class SplitParams(Strict):
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


class PackParams(Strict):
    seed: int = 0
    val_fraction: float = Field(default=0.05, gt=0, lt=1)
    """Share of each domain's documents held out (chosen by a hash of the document id)."""
    tolerance: float = Field(default=0.05, gt=0, lt=1)
    """Largest allowed gap between achieved and requested share of any domain."""
    groups: dict[str, dict[str, float]] = Field(default_factory=dict)
    """Named sub-mixes (ProLong's ShortMix): group -> {domain: share}."""
    splits: dict[str, SplitParams] = Field(min_length=1)


# ---------------------------------------------------------------- model and training


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


class SeqPETraining(Strict):
    """SeqPE's regularisers and position shifts (the SeqPE paper and its official text runs' settings),
    applied by the training loop to SeqPE models only."""

    contrastive_weight: float = Field(default=0.1, ge=0)
    distill_weight: float = Field(default=0.1, ge=0)
    shift_rate: float = Field(default=0.1, ge=0, le=1)
    """Steps whose positions are shifted by a random offset (distillation skipped there)."""
    max_position: PositiveInt = 20000
    """Positions the regularisers and the shifts sample from: [0, max_position)."""


class RunParams(Strict):
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
    document_mask: bool = True
    """Each packed document attends to itself alone, its positions from 0 (ProLong's choice); false:
    a packed sequence is one stream, its documents attending to those before them (the ablation's
    baseline). Validation is masked either way, so the two compare on one loss."""
    loss_chunk: PositiveInt = 2048
    activation_checkpointing: Recompute = "none"
    """Per block: none, full (recompute the block in the backward), halves (full, each half's backward
    apart: a smaller working set for one more forward of attention's projections), selective (keep matmul and
    attention outputs, recompute the elementwise work) or attention (full, but attention's output
    kept: its forward is not run twice)."""
    compile: bool = True
    """torch.compile each block and the loss on CUDA (CPU runs stay eager)."""
    offload: bool = False
    """FSDP2 CPU offload of parameters, gradients and optimizer state (GPU runs; the optimizer
    then steps on the CPU): for sequences too long for the GPU otherwise."""
    offload_activations: bool = False
    """With full (or halves) activation checkpointing: each block's saved input goes to pinned host memory
    during the forward (overlapped) and comes back for its recomputation (GPU runs). At millions
    of tokens those inputs, not the weights, fill the GPU."""
    offload_keep_last: NonNegativeInt = 0
    """With offload_activations: the last N blocks keep their inputs on the GPU. Their backward
    comes first, so they would come straight back; and the host need not hold every input (at 2M
    tokens of the 8B shape on four GPUs, all 32 are 512 GiB: a whole 4-GPU host's memory)."""
    mlp_tile: PositiveInt | None = None
    """Tokens per MLP tile: the [tokens, ffn_dim] intermediates exist for one tile at a time (the
    backward runs each tile's forward again). None: untiled."""
    acp_eps: float | None = Field(default=None, gt=0, lt=1)
    """Adaptive Computation Pruning of FoX attention: skip tiles whose entries each carry under
    eps / L of their row (the paper's e^-10 = 4.54e-5). Needs the 'fox' attention backend
    (CUDA); the pruned fraction is logged per step. None: off."""
    sequence_parallel: PositiveInt = 1
    """Ranks that share each sequence (Ulysses); must divide the world size and the heads, and on
    several nodes the ranks of one node (its all-to-alls stay on the node's own links)."""
    sharding: Literal["hybrid", "full"] = "hybrid"
    """On several nodes: hybrid shards the weights and optimizer state over the ranks of each node
    and replicates them across nodes (HSDP: only the gradients' all-reduce crosses the network);
    full shards them over every rank (1/nodes the memory of hybrid, every gather across the
    network). One node: the same."""
    seqpe: SeqPETraining = SeqPETraining()

    PLACEMENT: ClassVar[frozenset[str]] = frozenset({"sharding"})
    """Fields that place the work on the ranks without changing what is computed: a run resumes
    across them (written with hybrid sharding on 2 nodes, resumed fully sharded on 1), and a
    recorded recipe leaves them out."""

    @model_validator(mode="after")
    def _offload_needs_full_recomputation(self) -> RunParams:
        if self.offload_activations and self.activation_checkpointing not in ("full", "halves"):
            raise ValueError(f"offload_activations moves the block inputs that full recomputation keeps; "
                             f"activation_checkpointing is {self.activation_checkpointing!r}: set it to full "
                             f"or halves")
        if self.offload_keep_last and not self.offload_activations:
            raise ValueError(f"offload_keep_last ({self.offload_keep_last}) keeps some block inputs on the GPU "
                             f"of those offload_activations moves, which is off")
        return self


class Phase(Strict):
    split: str
    steps: PositiveInt


class StageParams(RunParams):
    split: str
    """The packed split (pack.splits) it trains on."""
    curriculum: list[Phase] = Field(default_factory=list)
    """Splits trained on before `split`, each for its steps (counted in `steps`), under the same
    optimizer and learning-rate schedule: gpu-64k's base learns retrieval on short documents
    first, then across its window (bench/tiny_retrieval_notes.md)."""
    val_sequences: PositiveInt = 64
    """Validation sequences scored at the end (of `split`)."""

    @model_validator(mode="after")
    def _curriculum_fits(self) -> StageParams:
        if (first := sum(p.steps for p in self.curriculum)) >= self.steps:
            raise ValueError(f"curriculum: its phases take {first} of the {self.steps} steps; `split` needs some")
        return self


class PretrainStageParams(StageParams):
    rope_theta: float | None = Field(default=None, gt=1)
    """RoPE base for this stage (ProLong: 8e6 at 64K, 1.28e8 at 512K); null keeps the model's."""


class PretrainParams(Strict):
    init: str = "base"
    """"base" (the base stage's model) or an HF checkpoint directory."""
    factors: str | None = None
    """A LongRoPE factors JSON (HF longrope form), or "search" for the rope_search stage's output.
    Replaces the base change; documents within the original window keep the original RoPE (mixed
    context window)."""
    stages: list[PretrainStageParams] = Field(min_length=1)


class SlurmParams(Strict):
    """A training stage as a Slurm batch job (train/slurm.py): its command submits the job, streams
    the job's log and cancels it when stopped; in the job, srun runs the stage on each of
    train.nodes nodes. Not a recipe parameter."""

    enabled: bool = False
    partition: str | None = None
    account: str | None = None
    time: str = Field(default="24:00:00", pattern=r"^(\d+-)?\d+(:\d\d){0,2}$")
    """The job's time limit, as sbatch takes it (days-hours:minutes:seconds)."""
    gpus_per_node: NonNegativeInt | None = None
    """GPUs a node (one training process each); default train.nproc; 0: a CPU job of train.nproc processes."""
    cpus_per_node: PositiveInt | None = None
    options: list[str] = []
    """More #SBATCH lines, as sbatch takes them: ["--qos=high", "--exclusive"]."""
    setup: list[str] = []
    """Shell lines the job runs before the stage (module load ..., source .venv/bin/activate)."""
    python: str | None = None
    """The interpreter the job runs the stage with; default the one submitting it."""
    poll_seconds: float = Field(default=5.0, gt=0)

    @field_validator("options")
    @classmethod
    def _options_are_flags(cls, v: list[str]) -> list[str]:
        for opt in v:
            if not opt.startswith("-") or "\n" in opt:
                raise ValueError(f"{opt!r}: an sbatch option, one line starting with - (--qos=high)")
        return v


class TrainParams(Strict):
    base: StageParams | None = None
    """Short-context training of a base model from scratch; null when pretrain starts from a
    pretrained checkpoint."""
    pretrain: PretrainParams
    sft: StageParams
    nproc: PositiveInt | Literal["auto"] = 1
    """Training processes on this machine (torchrun, one per GPU); "auto": one per visible GPU.
    Not a recipe parameter: the global batch is the same for any count."""
    nodes: PositiveInt = 1
    """Machines a training stage spans, each running the same stage command with nproc processes,
    met through torchrun's c10d rendezvous at rdzv_endpoint. Under Slurm (SLURM_NNODES) or a
    Kubeflow PyTorchJob (PET_NNODES) the launcher's count and head node are used instead."""
    rdzv_endpoint: str | None = Field(default=None, pattern=r"^[^:\s]+:\d+$")
    """host:port of the rendezvous, on one of the nodes (train.launch.PORT under Slurm by default)."""
    slurm: SlurmParams = SlurmParams()


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
