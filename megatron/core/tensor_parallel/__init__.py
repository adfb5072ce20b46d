"""Tensor-parallel building blocks: layers, communication, vocab-parallel loss, RNG."""
from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_lm_loss
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    SequenceParallelLayerNorm,
    SequenceParallelRMSNorm,
    VocabParallelEmbedding,
    init_method_normal,
    lm_head_input,
    parallel_lm_logits,
    scaled_init_method_normal,
)
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.core.tensor_parallel.random import (SEQUENCE_PARALLEL_RNG, RNGStatesTracker, checkpoint,
                                                  model_parallel_tracker)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "SequenceParallelLayerNorm",
    "SequenceParallelRMSNorm",
    "VocabParallelEmbedding",
    "init_method_normal",
    "lm_head_input",
    "parallel_lm_logits",
    "scaled_init_method_normal",
    "vocab_parallel_lm_loss",
    "copy_to_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "RNGStatesTracker",
    "SEQUENCE_PARALLEL_RNG",
    "checkpoint",
    "model_parallel_tracker",
]
