"""--log-optimizer-states-to-tensorboard: the norms and largest values of the optimizer's moments and weights, under
Megatron-DeepSpeed's TensorBoard names (its megatron/training.py training_log). Every rank calls it: the sums and
maxima are reduced over the ranks that hold other parts of the states."""
import math

import torch
import torch.distributed as dist

# Megatron-DeepSpeed's names: Adam's second moment (variance), its square root, the first moment (momentum; SGD's
# momentum buffer here), the weights the optimizer steps (ZeRO's fp32 partitions)
NAMES = ("variance", "variance_sqrt", "momentum", "weight")


def base_optimizer(engine) -> torch.optim.Optimizer:
    """The torch optimizer inside DeepSpeed's wrappers (ZeRO, bf16, fp16), the one holding the states."""
    optimizer = engine.optimizer
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _tensors(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> dict[str, torch.Tensor | None]:
    state = optimizer.state.get(param, {})
    variance = state.get("exp_avg_sq")
    return {"variance": variance, "variance_sqrt": None if variance is None else variance.sqrt(),
            "momentum": state.get("exp_avg", state.get("momentum_buffer")), "weight": param.detach()}


def local_sums(optimizer: torch.optim.Optimizer) -> tuple[torch.Tensor, torch.Tensor]:
    """(squared L2 norms then L1 norms of each of NAMES, 8 values; the largest absolute value of each, 4 values) over
    this rank's states (a state the optimizer does not have counts as zeros)."""
    sums, maxima = torch.zeros(2 * len(NAMES), dtype=torch.float64), torch.zeros(len(NAMES), dtype=torch.float64)
    for group in optimizer.param_groups:
        for param in group["params"]:
            for i, tensor in enumerate(_tensors(optimizer, param).values()):
                if tensor is None or tensor.numel() == 0:
                    continue
                tensor = tensor.float()
                sums[i] += tensor.square().sum().item()
                sums[len(NAMES) + i] += tensor.abs().sum().item()
                maxima[i] = max(maxima[i].item(), tensor.abs().max().item())
    return sums, maxima


def _reduce(sums: torch.Tensor, maxima: torch.Tensor, groups: list, device: torch.device):
    sums, maxima = sums.to(device), maxima.to(device)
    for group in groups:
        if group.size > 1:
            dist.all_reduce(sums, group=group.handle)
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group.handle)
    return sums.cpu(), maxima.cpu()


def optimizer_state_scalars(engine, parallel, device: torch.device) -> dict[str, float]:
    """Megatron-DeepSpeed's optimizer/<name>_l2, _l1 and _abs_max scalars. The states are summed over the tensor-
    and pipeline-parallel ranks (each holds other layers or shards: a replicated LayerNorm counts once per rank, as
    in Megatron-DeepSpeed) and over the ZeRO ranks where this rank holds a partition of its replica's states."""
    optimizer = base_optimizer(engine)
    sums, maxima = local_sums(optimizer)
    held = sum(p.numel() for group in optimizer.param_groups for p in group["params"])
    replica = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters() if p.requires_grad)
    groups = [parallel.tensor, parallel.pipeline] + ([parallel.sequence_data] if held < replica else [])
    sums, maxima = _reduce(sums, maxima, groups, device)
    values = {}
    for i, name in enumerate(NAMES):
        values[f"optimizer/{name}_l2"] = math.sqrt(sums[i].item())
        values[f"optimizer/{name}_l1"] = sums[len(NAMES) + i].item()
        values[f"optimizer/{name}_abs_max"] = maxima[i].item()
    return values
