"""The output layer and its cross-entropy in one step, over a vocabulary split across ranks.

Each rank computes logits[..., vocab_start:vocab_end] only; three [tokens] statistics cross
the group: the max (for stability), the target's logit, and the sum of exps. The logits go into
a scratch buffer that the exps overwrite in place and that then becomes the logits' gradient,
so a training step holds one [tokens, vocab] tensor and never the full-vocabulary logits.
"""
from __future__ import annotations

import torch

from megatron.core.scratch import ScratchBuffers
from megatron.core.tensor_parallel.mappings import all_reduce_max, all_reduce_sum, group_rank


def _local_targets(target: torch.Tensor, per_rank: int, group) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets as indices into this rank's vocab slice (0 where another rank owns them), and that mask."""
    vocab_start = group_rank(group) * per_rank
    outside = (target < vocab_start) | (target >= vocab_start + per_rank)
    return (target - vocab_start).masked_fill(outside, 0), outside


class _VocabParallelLMLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, group,
                scratch: ScratchBuffers, for_backward: bool):
        rows = hidden.reshape(-1, hidden.shape[-1])
        logits = scratch.take((rows.shape[0], weight.shape[0]), hidden.dtype, hidden.device)
        torch.mm(rows, weight.t(), out=logits)
        exp = logits
        if logits.dtype != torch.float32:  # the softmax statistics in fp32, as Megatron's .float()
            exp = scratch.take(logits.shape, torch.float32, logits.device).copy_(logits)
            scratch.give_back(logits)

        local_target, outside = _local_targets(target.reshape(-1), weight.shape[0], group)
        target_logit = all_reduce_sum(exp.gather(1, local_target.unsqueeze(1)).squeeze(1).masked_fill(outside, 0.0),
                                      group)
        logits_max = all_reduce_max(exp.amax(dim=1), group)
        exp.sub_(logits_max.unsqueeze(1)).exp_()
        sum_exp = all_reduce_sum(exp.sum(dim=1), group)
        loss = sum_exp.log().add_(logits_max).sub_(target_logit)

        if for_backward:
            ctx.save_for_backward(rows, weight, local_target, outside, sum_exp)
            ctx.exp, ctx.scratch, ctx.hidden_shape = exp, scratch, hidden.shape
        else:
            scratch.give_back(exp)
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        assert ctx.exp is not None, "the output layer's loss was back-propagated twice (its buffer is reused)"
        rows, weight, local_target, outside, sum_exp = ctx.saved_tensors
        grad_loss = grad_loss.reshape(-1)
        # d loss / d logit = softmax - one_hot(target): normalise and scale in one pass over the
        # saved exps, then the one-hot, only on the rank that owns the target.
        grad_logits = ctx.exp.mul_((grad_loss / sum_exp).unsqueeze(1))
        grad_logits.scatter_add_(1, local_target.unsqueeze(1), (-grad_loss).masked_fill(outside, 0.0).unsqueeze(1))
        grad_in_dtype = grad_logits
        if weight.dtype != grad_logits.dtype:
            grad_in_dtype = ctx.scratch.take(grad_logits.shape, weight.dtype, grad_logits.device).copy_(grad_logits)
        grad_hidden = torch.mm(grad_in_dtype, weight).view(ctx.hidden_shape)
        grad_weight = torch.mm(grad_in_dtype.t(), rows)
        ctx.scratch.give_back(grad_logits)
        if grad_in_dtype is not grad_logits:
            ctx.scratch.give_back(grad_in_dtype)
        ctx.exp = None
        return grad_hidden, grad_weight, None, None, None, None


def vocab_parallel_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, group,
                           scratch: ScratchBuffers) -> torch.Tensor:
    """Per-token fp32 loss [...] of the output layer `weight` [V/tp, h] (this rank's vocab slice)
    applied to `hidden` [..., h], the same on every rank of `group`; equal to the cross-entropy
    of the full logits F.linear(hidden, full_weight).
    `hidden` must already be replicated over the group (copy_to_tensor_model_parallel_region)."""
    assert hidden.shape[:-1] == target.shape, (
        f"expected hidden [..., h] over target [...], got {tuple(hidden.shape)} and {tuple(target.shape)}"
    )
    for_backward = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _VocabParallelLMLoss.apply(hidden, weight, target, group, scratch, for_backward)
