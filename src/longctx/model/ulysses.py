"""Ulysses sequence parallelism: the all-to-all that trades a token split for a head split.

Outside attention each rank of a sequence-parallel group holds 1/sp of a packed micro-batch's
tokens with all heads; attention needs every token of a document, so q, k, v (and the FoX gates)
are exchanged to hold all tokens of 1/sp of the heads, and the output is exchanged back. Each
exchange is one all_to_all_single; its gradient is the opposite exchange.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def bounds(n: int, group: dist.ProcessGroup | None) -> tuple[int, int]:
    """The token range [lo, hi) of n packed tokens that this rank of the group holds."""
    if group is None:
        return 0, n
    sp, rank = dist.get_world_size(group), dist.get_rank(group)
    if n % sp:
        raise ValueError(f"{n} tokens do not split over {sp} sequence-parallel ranks (pad the batch)")
    return rank * (n // sp), (rank + 1) * (n // sp)


def _seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[n, H, ...] (my tokens, all heads) -> [sp * n, H / sp, ...] (all tokens, my heads)."""
    sp = dist.get_world_size(group)
    n, h, rest = x.shape[0], x.shape[1], x.shape[2:]
    send = x.reshape(n, sp, h // sp, *rest).movedim(1, 0).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[j]: rank j's tokens, my heads
    return recv.reshape(sp * n, h // sp, *rest)


def _heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[sp * n, h, ...] (all tokens, my heads) -> [n, sp * h, ...] (my tokens, all heads)."""
    sp = dist.get_world_size(group)
    big, h, rest = x.shape[0], x.shape[1], x.shape[2:]
    send = x.reshape(sp, big // sp, h, *rest).contiguous()  # send[j]: rank j's tokens
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[j]: my tokens, rank j's heads
    return recv.movedim(0, 1).reshape(big // sp, sp * h, *rest)


class _Exchange(torch.autograd.Function):
    """One exchange forward, the opposite one backward."""

    @staticmethod
    def forward(ctx, x, group, to_heads: bool):
        ctx.group, ctx.to_heads = group, to_heads
        return (_seq_to_heads if to_heads else _heads_to_seq)(x, group)

    @staticmethod
    def backward(ctx, grad):
        return (_heads_to_seq if ctx.to_heads else _seq_to_heads)(grad, ctx.group), None, None


def seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return x if group is None else _Exchange.apply(x, group, True)


def heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return x if group is None else _Exchange.apply(x, group, False)
