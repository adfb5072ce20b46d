"""Cross-entropy over logits split by vocabulary, without gathering the full logits.

Each rank holds logits[..., vocab_start:vocab_end]; only three [batch, seq] statistics
cross the group: the max (for stability), the target's logit, and the sum of exps.
"""
from __future__ import annotations

import torch

from megatron.core.tensor_parallel.mappings import all_reduce_max, all_reduce_sum, group_rank


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local_logits: torch.Tensor, target: torch.Tensor, group):
        logits = local_logits.float()
        logits_max = all_reduce_max(logits.amax(dim=-1), group)
        shifted = logits - logits_max.unsqueeze(-1)

        per_rank = logits.size(-1)
        vocab_start = group_rank(group) * per_rank
        outside = (target < vocab_start) | (target >= vocab_start + per_rank)
        local_target = (target - vocab_start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        all_reduce_sum(target_logit, group)

        exp = shifted.exp_()  # in place: on a 50k vocabulary each [tokens, vocab] pass costs more than it looks
        sum_exp = all_reduce_sum(exp.sum(dim=-1), group)
        loss = sum_exp.log() - target_logit

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        ctx.logits_dtype = local_logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, local_target, outside = ctx.saved_tensors
        # d loss / d logit = softmax - one_hot(target), the one-hot only on the owning rank.
        # The saved softmax becomes the gradient in place (no [tokens, vocab] copy), so this
        # backward runs once per forward, as in training (no retain_graph).
        grad = softmax
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -(~outside).unsqueeze(-1).to(grad.dtype))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, target: torch.Tensor, group) -> torch.Tensor:
    """Per-token fp32 loss [...] from this rank's vocab slice of the logits [..., V/tp]."""
    return _VocabParallelCrossEntropy.apply(local_logits, target, group)
