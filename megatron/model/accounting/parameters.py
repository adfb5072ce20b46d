"""Parameter counts: the whole model, and what one tensor- and pipeline-parallel rank holds."""
from __future__ import annotations

from megatron.model.config import GPTConfig


def count_parameters(config: GPTConfig) -> int:
    """Parameters of GPTModel at TP=1, the tied word embedding counted once."""
    return parameters_on_rank(config)


def parameter_groups_on_rank(config: GPTConfig, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                             stage: int = 0) -> tuple[list[int], list[int]]:
    """Sizes of the parameters one tensor-parallel rank of pipeline `stage` holds, in module order, in
    megatron/optimizer.py's two groups: (matrices, which decay; biases and LayerNorm weights, which do not).
    Split matrices and their column biases count 1/tp; LayerNorms, row-parallel biases and position
    embeddings are whole on every TP rank (rotary positions have no table). Stage 0 holds the embeddings, the last stage the final
    LayerNorm and (with PP > 1) its own copy of the tied word embedding; each stage num_layers / pp layers."""
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    h, f = config.hidden_size, config.ffn_hidden_size
    words = config.padded_vocab_size // tp * h
    matrices, vectors = [], []
    if stage == 0:
        matrices += [words] + ([config.learned_positions * h] if config.learned_positions else [])
    for _ in range(config.num_layers // pp):
        matrices += [3 * h * h // tp, h * h // tp, h * f // tp, f * h // tp]  # QKV, attention out, MLP in, out
        # input LayerNorm (weight, bias), QKV and attention-out biases, LayerNorm, MLP in and out biases
        vectors += [h, h, 3 * h // tp, h, h, h, f // tp, h]
    if stage == pp - 1:
        vectors += [h, h]
        if pp > 1:
            matrices.append(words)
    return matrices, vectors


def parameters_on_rank(config: GPTConfig, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                       stage: int = 0) -> int:
    """Parameters one tensor-parallel rank of pipeline `stage` holds (tensor rank 0 of the first
    stage prints the memory lines)."""
    return sum(map(sum, parameter_groups_on_rank(config, tensor_parallel_size, pipeline_parallel_size, stage)))
