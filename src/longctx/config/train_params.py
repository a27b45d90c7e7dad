"""The train section of the params: a training run's settings (RunParams), the base, pretrain
and SFT stages, and Slurm."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, NonNegativeInt, PositiveInt, field_validator, model_validator

from ..model.config import Recompute
from .base import Strict

# ---------------------------------------------------------------- training


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
    first, then across its window (docs/retrieval.md)."""
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
