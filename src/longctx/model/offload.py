"""Activation checkpoints in host memory (train's `offload_activations`). Under full recomputation
a block keeps only its input for the backward: [local tokens, d_model] per layer, at 1M tokens of
the 8B shape on two GPUs 4 GiB a layer, 128 GiB over 32 layers, more than a GPU holds beside the
model. Each input goes to pinned host memory as the forward passes it (a copy on a side stream,
overlapped with the next blocks) and comes back for its block's recomputation; the backward
visits the blocks in reverse, so when one is taken back the copy of the one saved before it
starts (a prefetch, overlapped with this block's backward)."""

from __future__ import annotations

import contextlib
import weakref

import torch

MIN_BYTES = 1 << 20
"""Smaller saved tensors stay where they are: their copies would cost more than they free."""

PIECE = 1 << 21
"""The smallest piece of a host copy. PyTorch's pinned-memory allocator rounds every allocation up
to a power of two, so one 4.5 GiB block input (576K tokens of the 8B shape, 2,359,296 over SP 4)
would take 8 GiB of host memory; a copy in power-of-two pieces takes its size, rounded to this."""


def pieces(nbytes: int, smallest: int = PIECE) -> list[int]:
    """Power-of-two sizes, largest first, summing to `nbytes` rounded up to `smallest` (a power of two)."""
    total = -(-nbytes // smallest) * smallest
    return [1 << i for i in range(total.bit_length() - 1, -1, -1) if total >> i & 1]


def on(where: torch.device, device: torch.device) -> bool:
    """Whether a tensor `where` is on `device` ("cuda" holds cuda:0's: the first H100 run compared
    them with `==` and offloaded nothing)."""
    return where.type == device.type and (device.index is None or where.index == device.index)


class _OnHost:
    """One saved tensor in host memory (its elements in order over power-of-two `pieces`), and its
    copy back to the device once started: (tensor, the event it waits on). The copy back queues on
    the stream of the copy there, so nothing else orders the two."""

    __slots__ = ("host", "shape", "device", "back", "__weakref__")

    def __init__(self, host: list[torch.Tensor], shape: torch.Size, device: torch.device):
        self.host, self.shape, self.device = host, shape, device
        self.back: tuple[torch.Tensor, torch.cuda.Event | None] | None = None


def _spans(flat: torch.Tensor, host: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(elements of flat, the host piece's start that holds them), in order; the last piece may be longer."""
    out, start = [], 0
    for piece in host:
        n = min(piece.numel(), flat.numel() - start)
        out.append((flat[start:start + n], piece[:n]))
        start += n
    return out


class HostOffload:
    """saved_tensors_hooks that move what they save from `device` to host memory and back. One
    instance serves every block of a model: the prefetch follows the order of saving."""

    def __init__(self, device: torch.device, min_bytes: int = MIN_BYTES):
        self.device = device
        self.min_bytes = min_bytes
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._saved: list[weakref.ref[_OnHost]] = []
        """On the host and not yet taken back, in the order of saving (a graph freed without a
        backward drops its own)."""

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> torch.Tensor | _OnHost:
        if not on(t.device, self.device) or t.numel() * t.element_size() < self.min_bytes:
            return t
        host = [torch.empty(size // t.element_size(), dtype=t.dtype, pin_memory=self.stream is not None)
                for size in pieces(t.numel() * t.element_size())]
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # t is complete
        with self._side():
            for part, piece in _spans(t.reshape(-1), host):
                piece.copy_(part, non_blocking=True)
        if self.stream is not None:
            t.record_stream(self.stream)  # its memory is not reused before the copy is done
        item = _OnHost(host, t.shape, t.device)
        self._saved = [r for r in self._saved if r() is not None] + [weakref.ref(item)]
        return item

    def _unpack(self, item: torch.Tensor | _OnHost) -> torch.Tensor:
        if not isinstance(item, _OnHost):
            return item
        alive = [r() for r in self._saved]
        alive = [x for x in alive if x is not None]
        self._start_back(item)  # (first: the prefetch below queues behind it on the same stream)
        if item in alive:
            i = alive.index(item)
            if i > 0:
                self._start_back(alive[i - 1])
            alive.pop(i)
            self._saved = [weakref.ref(x) for x in alive]
        t, ready = item.back
        item.back = None  # (unpacked again, it is copied again)
        if ready is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(ready)
            t.record_stream(current)
        return t

    def _start_back(self, item: _OnHost) -> None:
        if item.back is not None:
            return
        with self._side():  # (on a GPU after its copy to the host, on the same stream)
            t = torch.empty(item.shape, dtype=item.host[0].dtype, device=item.device)
            for part, piece in _spans(t.view(-1), item.host):
                part.copy_(piece, non_blocking=True)
        ready = None
        if self.stream is not None:  # what the compute stream waits on before reading t
            ready = torch.cuda.Event()
            ready.record(self.stream)
        item.back = (t, ready)

    def _side(self) -> contextlib.AbstractContextManager:
        """The copies' stream (on a GPU; on a CPU they run where they are called)."""
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def pending(self) -> int:
        """Saved tensors on the host not yet taken back."""
        return sum(r() is not None for r in self._saved)
