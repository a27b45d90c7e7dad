"""Distributed training: FSDP2 over the ranks (HSDP across nodes), Ulysses sequence parallelism
inside groups.

A world of W ranks is split into W / sp data-parallel replicas of `sp` consecutive ranks (on
one node: torchrun numbers a node's ranks consecutively). The ranks of one sequence-parallel
group read the same micro-batch and each embed 1/sp of its tokens; around each attention core an
all-to-all trades that token split for a head split (every rank then holds every token of 1/sp of
the heads), and back after it (`sequence_parallel`). FSDP2 shards parameters and optimizer state
over the W ranks of one node, or, on N nodes, over each node's W / N ranks with the shards
replicated across nodes (a [N, W / N] mesh: HSDP), or over all W (`sharding: full`). Gradients
are summed, not averaged, because every rank's loss is already divided by the step's global
valid-token count.
On GPUs it is also the mixed precision: fp32 master weights, gradients and optimizer state
(sharded), bf16 weights gathered for compute, fp32 gradient reduction. A single GPU keeps the
same arithmetic with bf16 compute copies (precision.py), or, offloading, as FSDP2's world of
one. CPUs train in fp32 throughout (exact and reproducible).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ..errors import ConfigError
from ..model import ulysses
from ..model.transformer import Transformer
from .precision import attach


@dataclass(frozen=True)
class Parallel:
    """This process's place: rank in the world, its data-parallel replica and sequence slice."""

    rank: int = 0
    world: int = 1
    sp: int = 1
    sp_group: dist.ProcessGroup | None = None
    device: torch.device = torch.device("cpu")
    nodes: int = 1
    """Machines the world spans (torchrun's WORLD_SIZE / LOCAL_WORLD_SIZE): the mesh's replicas."""

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def dp(self) -> int:
        return self.world // self.sp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.sp

    @property
    def sp_rank(self) -> int:
        return self.rank % self.sp

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def sum(self, value: float | int) -> float:
        """The sum of a number over all ranks (every rank gets it)."""
        if not self.distributed:
            return value
        t = torch.tensor([float(value)], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return float(t.item())


def launched() -> bool:
    """Whether this process was started by torchrun (or any launcher setting the env vars)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init() -> Parallel:
    """Join the process group torchrun set up (NCCL on GPUs, gloo on CPU); a single process
    without torchrun. Each rank takes the GPU of its local rank. On GPUs the group also has gloo
    for host tensors: with CPU offload the gradients live in host memory and clipping reduces
    their norm there (NCCL alone: "No backend type associated with device type cpu")."""
    if not launched() or int(os.environ["WORLD_SIZE"]) == 1:
        return Parallel(device=torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        backend = "cuda:nccl,cpu:gloo"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30), device_id=device
                                if device.type == "cuda" else None)
    world = dist.get_world_size()
    return Parallel(rank=dist.get_rank(), world=world, device=device,
                    nodes=world // int(os.environ.get("LOCAL_WORLD_SIZE", world)))


def check_layout(cfg, world: int, where: str = "", n_heads: int | None = None, nodes: int = 1) -> None:
    """That a training config's batch and sequence parallelism fit `world` ranks on `nodes`
    machines and, where known, the model's `n_heads` (Ulysses deals heads to ranks) before any
    process starts, and again in the loop."""
    sp = cfg.sequence_parallel
    if world % sp:
        raise ConfigError(f"{where}sequence_parallel: {sp} does not divide the world size {world}")
    if (world // nodes) % sp:
        raise ConfigError(f"{where}sequence_parallel: {sp} does not divide the {world // nodes} ranks of a node: a "
                          "group's all-to-alls would cross the network")
    if n_heads is not None and n_heads % sp:
        raise ConfigError(f"{where}sequence_parallel: {sp} does not divide the model's {n_heads} attention heads")
    if cfg.grad_accum % (world // sp):
        raise ConfigError(f"{where}grad_accum: {cfg.grad_accum} micro-batches per step do not divide over "
                          f"{world // sp} data-parallel replicas ({world} ranks / sequence_parallel {sp})")


def with_sequence_parallel(par: Parallel, sp: int, n_heads: int) -> Parallel:
    """The same process with sequence-parallel groups of `sp` consecutive ranks."""
    if sp == par.sp:
        return par
    if par.world % sp:
        raise ConfigError(f"sequence_parallel: {sp} does not divide the world size {par.world}")
    if n_heads % sp:
        raise ConfigError(f"sequence_parallel: {sp} does not divide the model's {n_heads} attention heads")
    group = None
    if sp > 1:
        group, _ = dist.new_subgroups(group_size=sp)
    return replace(par, sp=sp, sp_group=group)


def sequence_parallel(model: Transformer, group: dist.ProcessGroup | None) -> Transformer:
    """Ulysses over `group` (None: nothing to do): every rank embeds 1/sp of each sequence's
    tokens, and each attention core, which needs whole documents, is wrapped in the all-to-alls
    that give it every token of 1/sp of the heads and take its output back. Applied once."""
    if group is None or model.sp_group is not None:
        return model
    model.sp_group = group
    for block in model.layers:
        block.self_attn.core = _exchanged(block.self_attn, group)
    return model


def _exchanged(attn, group: dist.ProcessGroup):
    core = attn.core
    # grouped KV heads repeated to one per query head when the groups do not split over the ranks
    repeat = attn.h // attn.hk if attn.hk % dist.get_world_size(group) else 1

    def exchanged(q, k, v, log_f, k_gate, v_gate, ctx, last=False):
        if repeat > 1:
            k, v, k_gate, v_gate = (None if t is None else t.repeat_interleave(repeat, dim=1)
                                    for t in (k, v, k_gate, v_gate))
        heads = (None if t is None else ulysses.seq_to_heads(t, group) for t in (q, k, v, log_f, k_gate, v_gate))
        o, tiles = core(*heads, ctx, last)
        return ulysses.heads_to_seq(o, group), tiles

    return exchanged


def _world_of_one(device: torch.device) -> None:
    """A process group of this process alone (FSDP2 needs one), unless one exists."""
    if not dist.is_initialized():
        index = device.index if device.index is not None else torch.cuda.current_device()
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                device_id=torch.device("cuda", index))


def host_threads() -> int:
    """Threads for this process's host work: the machine's cores shared among the processes
    torchrun started on it. torchrun sets OMP_NUM_THREADS=1 when it starts several, which leaves
    an offloaded optimizer step (AdamW over billions of host parameters) on one core."""
    return max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))


def shard(model: Transformer, par: Parallel, offload: bool = False, sharding: str = "hybrid") -> Transformer:
    """FSDP2: one unit per transformer block, the rest (embeddings, final norm, head) in the root
    unit, sharded over one node's ranks and replicated across nodes (`sharding` hybrid) or over
    every rank (full); on GPUs with bf16 compute weights over fp32 master weights. A single GPU
    gets bf16 compute copies instead (the same arithmetic, 3-19% faster steps: precision.py), or
    FSDP2 as a world of one to offload. `offload`: parameters, gradients and optimizer state live
    in host memory between uses (the optimizer steps on the CPU). A no-op for a single CPU
    process."""
    gpu = par.device.type == "cuda"
    if not (par.distributed or gpu):
        if offload:
            raise ConfigError("offload: CPU offload moves GPU training state to host memory; this run has no GPU")
        return model
    if not (par.distributed or offload):
        attach(model)
        return model
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if not par.distributed:
        _world_of_one(par.device)
    if offload:
        torch.set_num_threads(max(torch.get_num_threads(), host_threads()))
    options = {"mesh": mesh(par, sharding), "offload_policy": CPUOffloadPolicy() if offload else OffloadPolicy(),
               # a world of one gathers nothing: keep the bf16 weights from forward to backward
               "reshard_after_forward": par.distributed}
    if gpu:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, **options)
    fully_shard(model, **options)
    for unit in (*model.layers, model):
        unit.set_gradient_divide_factor(1.0)  # sum: each rank's loss is pre-divided by the global count
        unit.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no pre-multiplied sum)
    return model


def mesh(par: Parallel, sharding: str = "hybrid"):
    """FSDP2's device mesh: [nodes, ranks a node] (replicate, shard) for hybrid sharding on
    several nodes, else one dimension of every rank."""
    from torch.distributed.device_mesh import init_device_mesh

    if sharding == "hybrid" and par.nodes > 1:
        return init_device_mesh(par.device.type, (par.nodes, par.world // par.nodes),
                                mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(par.device.type, (par.world,))


def layout(model: Transformer, par: Parallel) -> str:
    """Where the weights and the sequences went, in words (a stage's log), read off a sharded
    weight's own mesh."""
    mesh = getattr(next(model.parameters()), "device_mesh", None)
    if mesh is None:
        where = "weights whole on each rank"
    elif mesh.ndim == 2:
        where = f"weights sharded over the {mesh.shape[1]} ranks of each node, replicated on {mesh.shape[0]} nodes"
    else:
        where = f"weights sharded over {mesh.shape[0]} ranks" + (f" on {par.nodes} nodes" if par.nodes > 1 else "")
    return where + (f"; each sequence split over {par.sp} ranks" if par.sp > 1 else "")


def sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def unshard(model: Transformer, par: Parallel) -> Transformer:
    """The trained weights as a plain (unsharded, fp32) model on every rank, for saving or the
    next curriculum stage (a collective when sharded; the model passed in is spent)."""
    if not sharded(model):
        return model
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    with torch.device("meta"):  # shapes only: the gathered tensors become its weights, no second copy
        whole = Transformer(model.cfg, model.attention_backend)
    whole.load_state_dict(state, assign=True)
    whole.tie_weights()
    whole.recompute = model.recompute
    return whole


def close() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
