"""A training step's data: which packed sequences a step reads (a pure function of seed and step,
so a resumed run reads what an uninterrupted one would), how they are dealt over the
data-parallel ranks (by attention cost, ProLong's reordering), and the micro-batches built of
them on the device."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from ..config import RunParams
from ..data.loader import Curriculum, PackedDataset
from ..model.loss import IGNORE, shift_labels
from ..model.transfer import to_device
from .parallel import Parallel


@dataclass
class Batch:
    ids: torch.Tensor
    cu_seqlens: torch.Tensor
    """On the host: the model reads document lengths there without a device sync (passed as a
    list, which FSDP's root hook does not move to the GPU as it does tensors)."""
    labels: torch.Tensor
    samples: list[int]
    valid: int
    """Tokens with a label in the whole micro-batch."""


@functools.lru_cache(maxsize=4)
def _epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


def sample_indices(step: int, per_step: int, n: int, seed: int) -> list[int]:
    """The dataset indices of one step: epochs are seeded permutations, walked in order."""
    return [int(_epoch_order(n, seed, g // n)[g % n]) for g in range(step * per_step, (step + 1) * per_step)]


def step_samples(data: PackedDataset | Curriculum, step: int, per_step: int, seed: int) -> list[int]:
    """sample_indices over a split, or over the split of the curriculum phase the step is in."""
    if not isinstance(data, Curriculum):
        return sample_indices(step, per_step, len(data), seed)
    k, begin = data.phase(step)
    return [data.offsets[k] + i for i in sample_indices(step - begin, per_step, len(data.parts[k]), seed)]


def attention_cost(cu_seqlens) -> int:
    """The sum of squared document lengths of a packed sequence (its boundaries, an array or a
    tensor): what its attention costs."""
    lengths = np.diff(np.asarray(cu_seqlens, dtype=np.int64))
    return int((lengths**2).sum())


def schedule(samples: list[int], costs: list[int], micro_batch: int, dp: int) -> list[list[list[int]]]:
    """Each data-parallel rank's micro-batches for one step. The step's sequences are sorted by
    attention cost and dealt so that the micro-batches ranks run side by side cost about the
    same (ProLong sorts the minibatches of a step by the sum of squared document lengths)."""
    ranked = [s for _, _, s in sorted(zip(costs, range(len(samples)), samples, strict=True))]
    per_rank: list[list[list[int]]] = [[] for _ in range(dp)]
    slot = micro_batch * dp
    for start in range(0, len(ranked), slot):
        for r in range(dp):
            per_rank[r].append(ranked[start + r * micro_batch:start + (r + 1) * micro_batch])
    return per_rank


def make_batch(data: PackedDataset | Curriculum, samples: list[int], device: torch.device, multiple: int = 1,
               documents: bool = True) -> Batch:
    """Packed sequences back to back; padded with one masked filler document to a multiple of
    `multiple` tokens (sequence parallelism splits the tokens evenly). `documents=False`: each
    packed sequence is one document to attention, positions and labels (the documents in it see
    each other: ProLong's unmasked baseline)."""
    ids, cus, labels = [], [], []
    offset = 0
    for i in samples:
        s = data[i]
        t = torch.from_numpy(s.input_ids.astype("int64"))
        cu = torch.from_numpy(s.cu_seqlens.astype("int64") if documents else np.array([0, t.numel()]))
        mask = None if s.loss_mask is None else torch.from_numpy(s.loss_mask.astype("int64"))
        labels.append(shift_labels(t, cu, mask))
        ids.append(t)
        cus.append(cu[:-1] + offset)
        offset += t.numel()
    if pad := -offset % multiple:
        ids.append(torch.zeros(pad, dtype=torch.int64))
        labels.append(torch.full((pad,), IGNORE, dtype=torch.int64))
        cus.append(torch.tensor([offset]))
        offset += pad
    cu_all = torch.cat([*cus, torch.tensor([offset])]).to(torch.int32)
    labels = torch.cat(labels)
    return Batch(to_device(torch.cat(ids), device), cu_all, to_device(labels, device), samples,
                 int((labels != IGNORE).sum()))


def step_batches(data: PackedDataset | Curriculum, step: int, cfg: RunParams,
                 par: Parallel) -> tuple[list[int], list[Batch]]:
    """A step's samples, and this rank's micro-batches of them on its device."""
    samples = step_samples(data, step, cfg.micro_batch * cfg.grad_accum, cfg.seed)
    costs = [attention_cost(data[i].cu_seqlens) for i in samples]
    mine = schedule(samples, costs, cfg.micro_batch, par.dp)[par.dp_rank]
    return samples, [make_batch(data, ids, par.device, par.sp, cfg.document_mask) for ids in mine]


def packed_batch(ids: torch.Tensor, cu_seqlens: torch.Tensor, device: torch.device, samples: list[int]) -> Batch:
    """One packed sequence of host ids and boundaries as a Batch: next-token labels within each
    document, ids and labels on `device`, boundaries kept on the host."""
    labels = shift_labels(ids, cu_seqlens.long())
    return Batch(to_device(ids, device), cu_seqlens, to_device(labels, device), samples,
                 int((labels != IGNORE).sum()))
