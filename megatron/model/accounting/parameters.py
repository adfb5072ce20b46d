"""Parameter counts: the whole model, and what one tensor- and pipeline-parallel rank holds."""
from __future__ import annotations

from megatron.model.config import GPTConfig


def count_parameters(config: GPTConfig) -> int:
    """Parameters of GPTModel at TP=1, the tied word embedding counted once (an untied output layer apart)."""
    return parameters_on_rank(config)


def parameter_groups_on_rank(config: GPTConfig, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                             stage: int = 0) -> tuple[list[int], list[int]]:
    """Sizes of the parameters one tensor-parallel rank of pipeline `stage` holds, in module order, in
    megatron/optimizer.py's two groups: (matrices, which decay; biases and LayerNorm weights, which do not).
    Split matrices and their column biases count 1/tp; LayerNorms, row-parallel biases and position
    embeddings are whole on every TP rank (rotary positions have no table). Stage 0 holds the embeddings, the last stage the final
    LayerNorm and (with PP > 1) its own copy of the tied word embedding; each stage num_layers / pp layers.
    Llama's shapes: RMSNorm has no bias, --disable-bias-linear drops the linear biases, QKV is h + 2 x the K/V
    width (grouped-query attention), SwiGLU's first matrix 2 ffn wide, and an untied output layer is the last
    stage's own [vocab / tp, h] matrix."""
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    h, f, qkv = config.hidden_size, config.ffn_hidden_size, config.hidden_size + 2 * config.kv_channels
    words = config.padded_vocab_size // tp * h
    norm = [h] if config.normalization == "rmsnorm" else [h, h]  # weight (and bias)
    bias = not config.disable_bias_linear
    matrices, vectors = [], []
    if stage == 0:
        matrices += [words] + ([config.learned_positions * h] if config.learned_positions else [])
    for _ in range(config.num_layers // pp):
        # QKV, attention out, MLP in (SwiGLU: gate and up), MLP out
        matrices += [h * qkv // tp, h * h // tp, h * config.ffn_input_width // tp, f * h // tp]
        # input norm, QKV and attention-out biases, norm, MLP in and out biases
        vectors += norm + ([qkv // tp, h] if bias else []) + norm + ([config.ffn_input_width // tp, h] if bias else [])
    if stage == pp - 1:
        vectors += norm
        if pp > 1 or config.untie_embeddings_and_output_weights:
            matrices.append(words)  # the tied embedding's copy, or the untied output layer
    return matrices, vectors


def parameters_on_rank(config: GPTConfig, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                       stage: int = 0) -> int:
    """Parameters one tensor-parallel rank of pipeline `stage` holds (tensor rank 0 of the first
    stage prints the memory lines)."""
    return sum(map(sum, parameter_groups_on_rank(config, tensor_parallel_size, pipeline_parallel_size, stage)))
