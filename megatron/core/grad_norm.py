"""The global gradient norm of a model split over tensor- and pipeline-parallel ranks.

Each parameter must count exactly once: split (tensor_model_parallel) parameters on every
tensor rank, replicated ones on tensor rank 0 only, and a weight tied across pipeline
stages only on the stage DeepSpeed did not mark `ds_pipe_replicated`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def counts_in_norm(param: torch.nn.Parameter, tensor_rank: int) -> bool:
    if getattr(param, "ds_pipe_replicated", False):
        return False
    return tensor_rank == 0 or bool(getattr(param, "tensor_model_parallel", False))


def model_parallel_grad_norm(params, tensor_rank: int = 0, group=None) -> torch.Tensor:
    """L2 norm over the gradients of all of `params` on all ranks of `group` (the model-parallel
    group: every TP x PP rank of one replica); None group = one process holds the whole model."""
    params = list(params)
    grads = [p.grad for p in params if p.grad is not None and counts_in_norm(p, tensor_rank)]
    # on the parameters' device: NCCL reduces accelerator tensors only
    square = torch.zeros((), dtype=torch.float32, device=params[0].device if params else None)
    if grads:
        square = torch.stack([g.detach().float().norm() for g in grads]).square().sum().to(square.device)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(square, group=group)
    return square.sqrt()
