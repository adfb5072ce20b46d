"""The output layer and its cross-entropy in one step, over a vocabulary split across ranks.

Each rank computes logits[..., vocab_start:vocab_end] only; three [tokens] statistics cross
the group: the max (for stability), the target's logit, and the sum of exps. The logits go into
a scratch buffer that the exps overwrite in place and that then becomes the logits' gradient,
so a training step holds one [tokens, vocab] tensor and never the full-vocabulary logits; tiled
(--tiled-logits-loss), one [tile tokens, vocab] tensor, recomputed in the backward.
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


def _exps_buffer(rows: torch.Tensor, weight: torch.Tensor, scratch: ScratchBuffers, buffer_rows: int) -> torch.Tensor:
    """A scratch [buffer_rows, vocab slice] fp32 buffer whose first rows hold `rows`' logits (a last tile may be
    shorter than the buffer)."""
    shape = (buffer_rows, weight.shape[0])
    logits = scratch.take(shape, rows.dtype, rows.device)
    torch.mm(rows, weight.t(), out=logits[:rows.shape[0]])
    if logits.dtype == torch.float32:
        return logits
    exp = scratch.take(shape, torch.float32, logits.device)  # the softmax statistics in fp32, as Megatron's .float()
    exp[:rows.shape[0]].copy_(logits[:rows.shape[0]])
    scratch.give_back(logits)
    return exp


def _statistics(exp: torch.Tensor, local_target: torch.Tensor, outside: torch.Tensor,
                group) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(target logit, max logit, sum of exps) per token over the whole vocabulary; `exp`'s logits become
    exp(logit - max) in place."""
    target_logit = all_reduce_sum(exp.gather(1, local_target.unsqueeze(1)).squeeze(1).masked_fill(outside, 0.0),
                                  group)
    logits_max = all_reduce_max(exp.amax(dim=1), group)
    exp.sub_(logits_max.unsqueeze(1)).exp_()
    return target_logit, logits_max, all_reduce_sum(exp.sum(dim=1), group)


def _grad_logits(exp: torch.Tensor, grad_loss: torch.Tensor, sum_exp: torch.Tensor, local_target: torch.Tensor,
                 outside: torch.Tensor) -> torch.Tensor:
    """d loss / d logit = softmax - one_hot(target), scaled by the loss's gradient: normalise and scale in one pass
    over the exps (in place), then the one-hot, only on the rank that owns the target."""
    grad_logits = exp.mul_((grad_loss / sum_exp).unsqueeze(1))
    return grad_logits.scatter_add_(1, local_target.unsqueeze(1),
                                    (-grad_loss).masked_fill(outside, 0.0).unsqueeze(1))


class _VocabParallelLMLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, group,
                scratch: ScratchBuffers, for_backward: bool):
        rows = hidden.reshape(-1, hidden.shape[-1])
        exp = _exps_buffer(rows, weight, scratch, rows.shape[0])
        local_target, outside = _local_targets(target.reshape(-1), weight.shape[0], group)
        target_logit, logits_max, sum_exp = _statistics(exp, local_target, outside, group)
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
        grad_logits = _grad_logits(ctx.exp, grad_loss.reshape(-1), sum_exp, local_target, outside)
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


class _TiledVocabParallelLMLoss(torch.autograd.Function):
    """--tiled-logits-loss (ALST's tiled logits and loss): the same loss `tiles` tiles of tokens at a time, one
    tile's [tokens, vocab slice] buffer alive at once. The forward keeps the per-token max and sum of exps; the
    backward recomputes each tile's logits from them (no collective) and sums the weight's gradient over the
    tiles. DeepSpeed's TiledFusedLogitsLoss does not fit: it reduces the loss to a scalar and back-propagates in
    the forward with a gradient of 1, where this loss returns per-token losses whose gradient (the loss mask's
    weights) arrives only in the backward."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, group,
                scratch: ScratchBuffers, for_backward: bool, tiles: int):
        rows = hidden.reshape(-1, hidden.shape[-1])
        local_target, outside = _local_targets(target.reshape(-1), weight.shape[0], group)
        tile_rows = -(-rows.shape[0] // tiles)
        loss, logits_max, sum_exp = (rows.new_empty(rows.shape[0], dtype=torch.float32) for _ in range(3))
        for start in range(0, rows.shape[0], tile_rows):
            tile = slice(start, start + tile_rows)
            exp = _exps_buffer(rows[tile], weight, scratch, tile_rows)
            tile_exp = exp[:rows[tile].shape[0]]
            target_logit, logits_max[tile], sum_exp[tile] = _statistics(tile_exp, local_target[tile], outside[tile],
                                                                        group)
            loss[tile] = sum_exp[tile].log().add_(logits_max[tile]).sub_(target_logit)
            scratch.give_back(exp)
        if for_backward:
            ctx.save_for_backward(rows, weight, local_target, outside, logits_max, sum_exp)
            ctx.scratch, ctx.hidden_shape, ctx.tile_rows = scratch, hidden.shape, tile_rows
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        rows, weight, local_target, outside, logits_max, sum_exp = ctx.saved_tensors
        grad_loss, tile_rows = grad_loss.reshape(-1), ctx.tile_rows
        grad_hidden = torch.empty_like(rows)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in range(0, rows.shape[0], tile_rows):
            tile = slice(start, start + tile_rows)
            exp = _exps_buffer(rows[tile], weight, ctx.scratch, tile_rows)
            tile_exp = exp[:rows[tile].shape[0]].sub_(logits_max[tile].unsqueeze(1)).exp_()
            grad_logits = _grad_logits(tile_exp, grad_loss[tile], sum_exp[tile], local_target[tile], outside[tile])
            grad_in_dtype = grad_logits.to(weight.dtype)
            torch.mm(grad_in_dtype, weight, out=grad_hidden[tile])
            grad_weight.addmm_(grad_in_dtype.t().to(torch.float32), rows[tile].to(torch.float32))
            ctx.scratch.give_back(exp)
        return grad_hidden.view(ctx.hidden_shape), grad_weight.to(weight.dtype), None, None, None, None, None


def vocab_parallel_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, group,
                           scratch: ScratchBuffers, tiles: int = 1) -> torch.Tensor:
    """Per-token fp32 loss [...] of the output layer `weight` [V/tp, h] (this rank's vocab slice)
    applied to `hidden` [..., h], the same on every rank of `group`; equal to the cross-entropy
    of the full logits F.linear(hidden, full_weight).
    `hidden` must already be replicated over the group (copy_to_tensor_model_parallel_region).
    tiles > 1: computed that many tiles of tokens at a time (--tiled-logits-loss), the same losses and gradients."""
    assert hidden.shape[:-1] == target.shape, (
        f"expected hidden [..., h] over target [...], got {tuple(hidden.shape)} and {tuple(target.shape)}"
    )
    for_backward = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    if tiles > 1:
        return _TiledVocabParallelLMLoss.apply(hidden, weight, target, group, scratch, for_backward, tiles)
    return _VocabParallelLMLoss.apply(hidden, weight, target, group, scratch, for_backward)
