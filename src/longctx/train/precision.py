"""Mixed precision on a single GPU without FSDP's machinery: the model's parameters stay the
fp32 master weights (what the optimizer steps, checkpoints save and the next stage receives);
forward and backward run on bf16 copies swapped in for the step. Each copy's gradient is added
to its master's fp32 gradient as soon as backward finishes with it, so micro-batches accumulate
in fp32 and no bf16 gradient outlives its layer. The arithmetic is FSDP2's
MixedPrecisionPolicy(bf16, fp32) in a world of one (parallel.py), without its per-block hooks,
collectives and copies: compiled steps at 16K tokens on an H200 took 3-5% less time for the
Transformers and 7-19% less for FoX (Pro) with ACP (docs/training-speed.md)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


class ComputeWeights:
    """bf16 copies of a model's floating-point parameters, refreshed from the masters each time
    they are swapped in (a cast of every weight: ~1 ms for 760M parameters on an H200)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype = torch.bfloat16):
        self.slots: list[tuple[nn.Module, str, nn.Parameter, nn.Parameter]] = []
        copies: dict[int, nn.Parameter] = {}  # tied weights share one copy, as they share one master
        for module in model.modules():
            for name, master in module._parameters.items():
                if master is None or not master.is_floating_point():
                    continue
                if id(master) not in copies:
                    copy = nn.Parameter(torch.empty_like(master, dtype=dtype), requires_grad=master.requires_grad)
                    if master.requires_grad:
                        copy.register_post_accumulate_grad_hook(_into(master))
                    copies[id(master)] = copy
                self.slots.append((module, name, master, copies[id(master)]))
        unique = {id(m): (m, copies[id(m)]) for _, _, m, _ in self.slots}
        self.masters = [m for m, _ in unique.values()]
        self.copies = [c for _, c in unique.values()]

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Forward and backward inside see the bf16 copies (recomputed blocks too)."""
        with torch.no_grad():
            torch._foreach_copy_(self.copies, self.masters)
        for module, name, _, copy in self.slots:
            module._parameters[name] = copy
        try:
            yield
        finally:
            for module, name, master, _ in self.slots:
                module._parameters[name] = master


def _into(master: nn.Parameter):
    def accumulate(copy: nn.Parameter) -> None:
        if master.grad is None:
            master.grad = copy.grad.to(master.dtype)
        else:
            master.grad.add_(copy.grad)
        copy.grad = None

    return accumulate


def attach(model: nn.Module) -> None:
    """Give `model` bf16 compute copies (once; `computing` then swaps them in)."""
    if getattr(model, "compute_weights", None) is None:
        model.compute_weights = ComputeWeights(model)
