"""Parameter counts: the whole model, and what one tensor- and pipeline-parallel rank holds."""
from __future__ import annotations

from megatron.model.config import GPTConfig
from megatron.model.recipe import layer_recipes, mlp_part, norm_part


def count_parameters(config: GPTConfig) -> int:
    """Parameters of GPTModel at TP=1, the tied word embedding counted once (an untied output layer apart),
    every expert of every MoE layer included."""
    return parameters_on_rank(config) + sum(map(sum, expert_groups_on_rank(config)))


def active_parameters(config: GPTConfig) -> int:
    """Parameters one token goes through: everything but the experts, and --topk experts of each MoE layer (the
    gate and a residual MoE's dense MLP are outside the experts). A dense model's are all of them."""
    experts_per_token = sum(config.topk for n in config.layer_experts if n > 1)
    return parameters_on_rank(config) + experts_per_token * sum(map(sum, mlp_part(config).parameters(config)))


def expert_groups_on_rank(config: GPTConfig, expert_parallel_size: int = 1) -> tuple[list[int], list[int]]:
    """Sizes of the expert parameters one rank holds (each MoE layer's experts / EP, each a dense MLP at TP=1), in
    megatron/optimizer.py's groups (matrices; biases), which ZeRO partitions over the expert-data-parallel ranks."""
    groups = [recipe.expert_parameters(expert_parallel_size) for recipe in layer_recipes(config)]
    return [size for matrices, _ in groups for size in matrices], [size for _, biases in groups for size in biases]


def parameter_groups_on_rank(config: GPTConfig, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                             stage: int = 0) -> tuple[list[int], list[int]]:
    """Sizes of the parameters one tensor-parallel rank of pipeline `stage` holds, in module order, in
    megatron/optimizer.py's two groups: (matrices, which decay; biases and LayerNorm weights, which do not).
    Split matrices and their column biases count 1/tp; LayerNorms, row-parallel biases and position
    embeddings are whole on every TP rank (rotary positions have no table). Stage 0 holds the embeddings, the last stage the final
    LayerNorm and (with PP > 1) its own copy of the tied embedding module (the word embedding and an unused
    position table); each stage num_layers / pp layers.
    Each layer's own parameters are its recipe's (megatron/model/recipe.py: the norm's, the attention's, the MLP's;
    an MoE layer's MLP is its gate, and a residual MoE's dense MLP and coefficient: the experts are
    expert_groups_on_rank's); an untied output layer is the last stage's own [vocab / tp, h] matrix."""
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    h = config.hidden_size
    words = config.padded_vocab_size // tp * h
    norm = norm_part(config).vectors(h)
    matrices, vectors = [], []
    if stage == 0:
        matrices += [words] + ([config.learned_positions * h] if config.learned_positions else [])
    layers = config.num_layers // pp
    for recipe in layer_recipes(config)[stage * layers:(stage + 1) * layers]:
        layer_matrices, layer_vectors = recipe.parameters(tp)
        matrices += layer_matrices
        vectors += layer_vectors
    if stage == pp - 1:
        vectors += norm
        if config.untie_embeddings_and_output_weights:
            matrices.append(words)  # the untied output layer
        elif pp > 1:  # the tied embedding's copy: the whole EmbeddingPipe, its (unused) position table too
            matrices += [words] + ([config.learned_positions * h] if config.learned_positions else [])
    return matrices, vectors


def parameters_on_rank(config: GPTConfig, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                       stage: int = 0) -> int:
    """Parameters one tensor-parallel rank of pipeline `stage` holds besides the experts, all of a dense model's
    (tensor rank 0 of the first stage prints the memory lines)."""
    return sum(map(sum, parameter_groups_on_rank(config, tensor_parallel_size, pipeline_parallel_size, stage)))
