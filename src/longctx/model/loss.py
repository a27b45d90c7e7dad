"""Cross-entropy over the vocabulary in token chunks, with its gradients computed in the forward
pass (as ProLong and Liger's fused linear cross-entropy): logits for 64K tokens x 128K vocabulary
never exist, and each chunk's logits are made once (two matmuls per chunk, not the three of a
recomputing backward). The softmax statistics and the loss are fp32; the matmuls run in the
weight's dtype (bf16 on GPU, with fp32 accumulation)."""

from __future__ import annotations

import functools

import torch

IGNORE = -100


def _chunk(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
           grads: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(summed loss, d loss / d hidden, d loss / d weight) of one chunk of tokens."""
    logits = (hidden @ weight.T).to(torch.promote_types(hidden.dtype, torch.float32))
    valid = labels != IGNORE
    target = labels.clamp(min=0)[:, None]
    lse = logits.logsumexp(-1)
    loss = torch.where(valid, lse - logits.gather(1, target)[:, 0], 0.0).sum()
    if not grads:
        return loss, None, None
    dlogits = (logits - lse[:, None]).exp_()
    dlogits.scatter_add_(1, target, -torch.ones_like(lse)[:, None])
    dlogits = (dlogits * valid[:, None]).to(weight.dtype)
    return loss, (dlogits @ weight).to(hidden.dtype), dlogits.T @ hidden.to(weight.dtype)


@functools.cache
def _compiled_chunk():
    # one fused kernel for the softmax work; inductor pads the vocabulary dimension of the
    # matmuls to an aligned size (50277 otherwise gets cuBLAS's unaligned kernels)
    return torch.compile(_chunk, dynamic=False)


class _ChunkedCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int,
                compiled: bool) -> torch.Tensor:
        grads = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        step = _compiled_chunk() if compiled else _chunk
        acc = torch.promote_types(hidden.dtype, torch.float32)
        total = torch.zeros((), dtype=acc, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if grads else None
        grad_weight = torch.zeros_like(weight, dtype=acc) if grads else None
        for a in range(0, hidden.shape[0], chunk):
            loss, gh, gw = step(hidden[a:a + chunk], weight, labels[a:a + chunk], grads)
            total += loss
            if grads:
                grad_hidden[a:a + chunk] = gh
                grad_weight += gw
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        return (grad_hidden * grad_total.to(grad_hidden.dtype), (grad_weight * grad_total).to(ctx.weight_dtype),
                None, None, None)


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                          chunk: int = 2048, compiled: bool = False) -> torch.Tensor:
    """Sum of token losses over `labels` != -100 (divide by the step's valid-token count).
    `compiled`: each chunk's math through torch.compile (CUDA)."""
    return _ChunkedCE.apply(hidden, weight, labels, chunk, compiled)


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
