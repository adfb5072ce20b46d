"""Tensor-parallel layers: plain nn.Modules that take their process group explicitly.

With group None (or one rank) each is the ordinary serial layer. With sequence_parallel the
activations entering a column-parallel layer and leaving a row-parallel one are split along
the sequence (Megatron's sequence parallelism): an all-gather replaces the identity before
the column layer and a reduce-scatter replaces the all-reduce after the row layer.
Weights are drawn as
the full master matrix from the default generator and then sliced, so a TP=2 model
built with the same seed holds exactly the shards of the TP=1 model.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    group_rank,
    group_size,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)

InitMethod = Callable[[torch.Tensor], torch.Tensor]


def init_method_normal(std: float) -> InitMethod:
    def init(tensor: torch.Tensor) -> torch.Tensor:
        return nn.init.normal_(tensor, mean=0.0, std=std)

    return init


def scaled_init_method_normal(std: float, num_layers: int) -> InitMethod:
    """GPT-2's init for projections that add into the residual stream: std / sqrt(2 L)."""
    return init_method_normal(std / math.sqrt(2.0 * num_layers))


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} {numerator} is not divisible by tensor-parallel size {denominator}")
    return numerator // denominator


def fp32_cpu_init(shape: tuple[int, ...], init_method: InitMethod) -> torch.Tensor:
    """Initial values drawn in fp32 on the CPU generator, whatever device and dtype new tensors get.
    Under deepspeed.zero.Init torch.empty returns ZeRO's dtype on its device (bf16 on the GPU, drawn by the
    GPU's generator), so ZeRO-3 would start from other weights than the other stages; the explicit device
    keeps the draw on the CPU and .to() undoes the dtype (Megatron's _initialize_affine_weight_cpu)."""
    if torch.empty(0).is_meta:  # a model built on the meta device (shapes and counts only) draws nothing
        return torch.empty(shape, dtype=torch.float32)
    master = torch.empty(shape, dtype=torch.float32, device="cpu").to(torch.float32)
    init_method(master)
    return master


def strided_shard(full: torch.Tensor, dim: int, group, stride: int = 1) -> torch.Tensor:
    """This rank's slice of `full` along `dim`: with stride k the dimension is k blocks (a gated MLP's gate and up),
    each split over the group, and the rank holds its part of every block, in block order (Megatron's
    partition_stride): each rank's gate and up halves then belong to the same hidden units."""
    blocks = full.chunk(stride, dim=dim)
    return torch.cat([block.chunk(group_size(group), dim=dim)[group_rank(group)] for block in blocks], dim=dim)


def _sharded_weight(
    full_shape: tuple[int, int], partition_dim: int, group, init_method: InitMethod, params_dtype: torch.dtype,
    stride: int = 1,
) -> nn.Parameter:
    """Initialise the full fp32 master weight, copy this rank's slice along `partition_dim` into the parameter
    (created where and as zero.Init wants it, if it is on)."""
    shard = strided_shard(fp32_cpu_init(full_shape, init_method), partition_dim, group, stride)
    weight = nn.Parameter(torch.empty(shard.shape, dtype=params_dtype))
    with torch.no_grad():
        weight.copy_(shard)
    mark_tensor_parallel(weight, partition_dim, parallel=group_size(group) > 1, stride=stride)
    return weight


def mark_tensor_parallel(param: nn.Parameter, partition_dim: int, parallel: bool = True, stride: int = 1) -> None:
    """The attributes DeepSpeed reads (deepspeed.runtime.utils.is_model_parallel_parameter)
    so that split parameters count on every rank in the grad norm, replicated ones once."""
    param.tensor_model_parallel = parallel
    param.partition_dim = partition_dim
    param.partition_stride = stride


class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A split by rows (output features) across the group."""

    def __init__(self, input_size: int, output_size: int, *, group, init_method: InitMethod,
                 bias: bool = True, gather_output: bool = False, params_dtype: torch.dtype = torch.float32,
                 sequence_parallel: bool = False, stride: int = 1):
        super().__init__()
        self.group = group
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel
        self.output_size_per_partition = divide(output_size, group_size(group) * stride, "output size") * stride
        self.weight = _sharded_weight((output_size, input_size), 0, group, init_method, params_dtype, stride)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.output_size_per_partition, dtype=params_dtype))
            mark_tensor_parallel(self.bias, 0, parallel=group_size(group) > 1, stride=stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.group)
        else:
            x = copy_to_tensor_model_parallel_region(x, self.group)
        y = F.linear(x, self.weight, self.bias)
        if self.gather_output:
            y = gather_from_tensor_model_parallel_region(y, self.group)
        return y


class RowParallelLinear(nn.Module):
    """y = x A^T + b with A split by columns (input features); partial sums are all-reduced."""

    def __init__(self, input_size: int, output_size: int, *, group, init_method: InitMethod,
                 bias: bool = True, input_is_parallel: bool = True, params_dtype: torch.dtype = torch.float32,
                 sequence_parallel: bool = False):
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError("a sequence-parallel RowParallelLinear needs input_is_parallel=True")
        self.group = group
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.input_size_per_partition = divide(input_size, group_size(group), "input size")
        self.weight = _sharded_weight((output_size, input_size), 1, group, init_method, params_dtype)
        # The bias is added once, after the reduction, so it is replicated.
        self.bias = nn.Parameter(torch.zeros(output_size, dtype=params_dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, self.group)
        partial = F.linear(x, self.weight)
        if not self.sequence_parallel:
            y = reduce_from_tensor_model_parallel_region(partial, self.group)
            return y if self.bias is None else y + self.bias
        y = reduce_scatter_to_sequence_parallel_region(partial, self.group)
        # Each rank adds the bias to its own sequence slice, so the bias gradient is the sum over ranks.
        return y if self.bias is None else y + copy_to_tensor_model_parallel_region(self.bias, self.group)


class _SequenceParallelNorm:
    """A norm (the torch class after this one in the bases) whose weights are replicated across the group while its
    input is split along the sequence: each rank's gradient covers only its slice, so the weights enter through
    copy_to_tensor_model_parallel_region, whose backward sums their gradients over the group. With group None or
    sequence_parallel False it is the torch norm."""

    def __init__(self, hidden_size: int, *, eps: float, group, sequence_parallel: bool,
                 params_dtype: torch.dtype = torch.float32):
        super().__init__(hidden_size, eps=eps, dtype=params_dtype)
        self.group = group
        self.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.sequence_parallel:
            return super().forward(x)
        weight = copy_to_tensor_model_parallel_region(self.weight, self.group)
        bias = getattr(self, "bias", None)  # RMSNorm has none
        bias = None if bias is None else copy_to_tensor_model_parallel_region(bias, self.group)
        return self._normalize(x, weight, bias)


class SequenceParallelLayerNorm(_SequenceParallelNorm, nn.LayerNorm):
    """LayerNorm (GPT-2's), sequence-parallel aware (_SequenceParallelNorm)."""

    def _normalize(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)


class SequenceParallelRMSNorm(_SequenceParallelNorm, nn.RMSNorm):
    """RMSNorm (torch's fused F.rms_norm; Llama's normalization: no mean, no bias), sequence-parallel aware
    (_SequenceParallelNorm)."""

    def _normalize(self, x: torch.Tensor, weight: torch.Tensor, bias: None) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, weight, self.eps)


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows; each rank looks up the ids it owns."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, group, init_method: InitMethod,
                 params_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.group = group
        per_rank = divide(num_embeddings, group_size(group), "padded vocab size")
        self.vocab_start = group_rank(group) * per_rank
        self.vocab_end = self.vocab_start + per_rank
        self.weight = _sharded_weight((num_embeddings, embedding_dim), 0, group, init_method, params_dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if group_size(self.group) == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        embedded = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_model_parallel_region(embedded, self.group)


def lm_head_input(hidden: torch.Tensor, group, sequence_parallel: bool = False) -> torch.Tensor:
    """The final hidden state as the vocab-parallel output layer takes it: replicated over the
    group (or, sequence parallel, gathered first), so its gradient is the sum over the vocab shards."""
    if sequence_parallel:
        return gather_from_sequence_parallel_region(hidden, group)
    return copy_to_tensor_model_parallel_region(hidden, group)


def parallel_lm_logits(hidden: torch.Tensor, word_embeddings_weight: torch.Tensor, group,
                       sequence_parallel: bool = False) -> torch.Tensor:
    """Logits for this rank's vocab slice, using the (tied) vocab-parallel embedding table."""
    return F.linear(lm_head_input(hidden, group, sequence_parallel), word_embeddings_weight)
