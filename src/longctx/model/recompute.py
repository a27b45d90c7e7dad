"""Activation checkpointing of a transformer block, by policy:

  none        keep every activation the backward needs
  full        keep the block's input only and run its forward again in the backward
  halves      full, the block's forward run again with its attention half checkpointed once more
              (keeping attention's output): the MLP half's backward comes first and runs without
              the attention half's activations, which are made again only for their own backward;
              one more forward of the attention half's projections, attention's own not run again
              (block.Block). Full's working set holds both halves' at once: of the 8B shape's
              step peak, the part that grows with the tokens is ~19 block inputs for FoX (Pro) under
              full, ~11 under halves; for the Transformer ~16 and ~13 (block_memory, docs/benchmarks.md)
  selective   keep the outputs of matmuls and attention, recompute the elementwise work between
              them (norms, activations, gates, RoPE, casts): most of full's memory saving on
              elementwise tensors, little of its compute
  attention   keep the block's input and attention's output (with its softmax statistics),
              recompute everything else: full's memory plus one [tokens, heads x head_dim] tensor
              per block, without running attention's forward twice (at 64K tokens and more the
              dearest part of full's recomputation)

Selective and attention recomputation work per operator (torch.utils.checkpoint's policy hooks), also inside
torch.compile'd blocks.
"""

from __future__ import annotations

import functools
from typing import get_args

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .config import Recompute

MODES: tuple[str, ...] = get_args(Recompute)

_ATEN_MATMULS = ("mm", "addmm", "bmm")
_ATEN_ATTENTION = ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention",
                   "_scaled_dot_product_efficient_attention", "_flash_attention_forward",
                   "_efficient_attention_forward", "_scaled_dot_product_flash_attention_for_cpu")
_OWN_ATTENTION = (("longctx", "doc_attention"), ("longctx", "fox_forward"), ("torch_attn", "_varlen_attn"))


def _saved_ops(matmuls: bool) -> set:
    """The operators whose outputs per-operator recomputation keeps: attention's, and with
    `matmuls` the matmuls' too (custom ops once registered)."""
    ops = {getattr(torch.ops.aten, name).default for name in _ATEN_ATTENTION + (_ATEN_MATMULS if matmuls else ())}
    for namespace, name in _OWN_ATTENTION:
        try:
            ops.add(getattr(getattr(torch.ops, namespace), name).default)
        except AttributeError:  # not registered (yet): its module was not imported
            pass
    return ops


def _policy(saved: set, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


def _per_operator(matmuls: bool):
    return create_selective_checkpoint_contexts(functools.partial(_policy, _saved_ops(matmuls)))


PER_OPERATOR = ("selective", "attention")
"""The modes that choose per operator: inside a compiled graph the checkpoint must be traced with
the block (train/compiled.py)."""


def recomputed(fn, mode: Recompute, *args):
    """fn(*args) under the recomputation policy `mode`."""
    if mode == "none":
        return fn(*args)
    if mode not in MODES:
        raise ValueError(f"activation checkpointing {mode!r} is unknown (known: {MODES})")
    extra = {"context_fn": functools.partial(_per_operator, mode == "selective")} if mode in PER_OPERATOR else {}
    return checkpoint(fn, *args, use_reentrant=False, **extra)
