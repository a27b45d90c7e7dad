"""Cross-entropy computed in chunks with recompute (ProLong): logits for 64K tokens x 128K
vocabulary are never materialized, in the forward or the backward pass."""

from __future__ import annotations

import torch

IGNORE = -100


class _ChunkedCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int) -> torch.Tensor:
        acc = torch.promote_types(hidden.dtype, torch.float32)  # fp32 at least
        total = torch.zeros((), dtype=acc, device=hidden.device)
        for a in range(0, hidden.shape[0], chunk):
            logits = (hidden[a:a + chunk] @ weight.T).to(acc)
            total += torch.nn.functional.cross_entropy(logits, labels[a:a + chunk], ignore_index=IGNORE,
                                                       reduction="sum")
        ctx.save_for_backward(hidden, weight, labels)
        ctx.chunk = chunk
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        hidden, weight, labels = ctx.saved_tensors
        acc = grad_total.dtype
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros_like(weight, dtype=acc)
        for a in range(0, hidden.shape[0], ctx.chunk):
            h, y = hidden[a:a + ctx.chunk], labels[a:a + ctx.chunk]
            probs = (h @ weight.T).to(acc).softmax(dim=-1)
            valid = y != IGNORE
            probs[valid, y[valid]] -= 1.0
            probs[~valid] = 0.0
            probs *= grad_total
            grad_hidden[a:a + ctx.chunk] = (probs.to(weight.dtype) @ weight).to(hidden.dtype)
            grad_weight += probs.T @ h.to(acc)
        return grad_hidden, grad_weight.to(weight.dtype), None, None


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                          chunk: int = 2048) -> torch.Tensor:
    """Sum of token losses over `labels` != -100 (divide by the step's valid-token count)."""
    return _ChunkedCE.apply(hidden, weight, labels, chunk)


def shift_labels(input_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                 loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Next-token labels for packed ids [N]: no target across a document boundary, none at the
    end, and none where `loss_mask` (on the target token) is 0."""
    labels = torch.full_like(input_ids, IGNORE)
    labels[:-1] = input_ids[1:]
    labels[cu_seqlens[1:].long() - 1] = IGNORE
    if loss_mask is not None:
        keep = torch.zeros_like(labels, dtype=torch.bool)
        keep[:-1] = loss_mask[1:].bool()
        labels[~keep] = IGNORE
    return labels
