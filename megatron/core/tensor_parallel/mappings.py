"""Every collective the tensor-parallel layers use, as paired forward/backward autograd functions.

Each function takes its process group explicitly. With group None or a group of one rank
they are the identity, so a TP=1 model runs the same code without communication.
Tensor-parallel regions split the last (hidden or vocab) dimension; sequence-parallel
regions split the sequence dimension, dim 1 of our [batch, seq, hidden] activations.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

SEQUENCE_DIM = 1


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    # A copy, so that a tensor autograd saved elsewhere is never changed in place.
    out = x.clone().contiguous()
    dist.all_reduce(out, group=group)
    return out


def _all_gather_into(out: torch.Tensor, x: torch.Tensor, group) -> None:
    # torch 2.13 adds all_gather_single and deprecates all_gather_into_tensor; 2.11 and 2.12 have only the
    # latter. Looked up at each call, so the traffic counter's wrapper (megatron/accounting/measure/comm_counter.py)
    # is the one used.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x, group=group)


def _reduce_scatter_into(out: torch.Tensor, x: torch.Tensor, group) -> None:
    # as _all_gather_into: reduce_scatter_single from torch 2.13, reduce_scatter_tensor before
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    reduce_scatter(out, x, group=group)


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's equal slice of `x` along `dim`."""
    world = group_size(group)
    if world == 1:
        return x
    if x.size(dim) % world:
        raise ValueError(f"dimension {dim} of size {x.size(dim)} does not split over {world} ranks")
    return x.chunk(world, dim=dim)[group_rank(group)].contiguous()


def _gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`."""
    world = group_size(group)
    if world == 1:
        return x
    # The collective concatenates along dim 0; move the wanted dim there and back.
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((world * moved.size(0),) + tuple(moved.shape[1:]))
    _all_gather_into(out, moved, group)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum over ranks, then keep this rank's slice along `dim`."""
    world = group_size(group)
    if world == 1:
        return x
    if x.size(dim) % world:
        raise ValueError(f"dimension {dim} of size {x.size(dim)} does not split over {world} ranks")
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((moved.size(0) // world,) + tuple(moved.shape[1:]))
    _reduce_scatter_into(out, moved, group)
    return out.movedim(0, dim).contiguous()


class _CopyToRegion(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient (each rank used the input on its shard)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    """All-reduce forward (sum of partial results); identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    """Keep this rank's slice of the last dim forward; gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, -1, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    """Gather the last dim forward; keep this rank's slice of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, -1, ctx.group), None


class _GatherFromSequenceRegion(torch.autograd.Function):
    """All-gather the sequence dim forward; reduce-scatter the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, SEQUENCE_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, SEQUENCE_DIM, ctx.group), None


class _ScatterToSequenceRegion(torch.autograd.Function):
    """Keep this rank's slice of the sequence dim forward; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, SEQUENCE_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, SEQUENCE_DIM, ctx.group), None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    """Reduce-scatter over the sequence dim forward; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, SEQUENCE_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, SEQUENCE_DIM, ctx.group), None


def copy_to_tensor_model_parallel_region(x, group):
    return _CopyToRegion.apply(x, group)


def reduce_from_tensor_model_parallel_region(x, group):
    return _ReduceFromRegion.apply(x, group)


def scatter_to_tensor_model_parallel_region(x, group):
    return _ScatterToRegion.apply(x, group)


def gather_from_tensor_model_parallel_region(x, group):
    return _GatherFromRegion.apply(x, group)


def gather_from_sequence_parallel_region(x, group):
    return _GatherFromSequenceRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x, group):
    return _ScatterToSequenceRegion.apply(x, group)


def reduce_scatter_to_sequence_parallel_region(x, group):
    return _ReduceScatterToSequenceRegion.apply(x, group)


def all_reduce_max(x: torch.Tensor, group) -> torch.Tensor:
    """In-place max over the group; a plain collective for the cross-entropy's stabiliser."""
    if group_size(group) > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
    return x


def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    """In-place sum over the group, outside autograd (cross-entropy statistics)."""
    if group_size(group) > 1:
        dist.all_reduce(x, group=group)
    return x
