"""Parameter counts: the whole model, and what one tensor- and pipeline-parallel rank holds."""
from __future__ import annotations

from megatron.model.config import GPTConfig


def count_parameters(config: GPTConfig) -> int:
    """Parameters of GPTModel at TP=1, the tied word embedding counted once (an untied output layer apart),
    every expert of every MoE layer included."""
    return parameters_on_rank(config) + sum(map(sum, expert_groups_on_rank(config)))


def active_parameters(config: GPTConfig) -> int:
    """Parameters one token goes through: everything but the experts, and --topk experts of each MoE layer (the
    gate and a residual MoE's dense MLP are outside the experts). A dense model's are all of them."""
    experts_per_token = sum(config.topk for n in config.layer_experts if n > 1)
    return parameters_on_rank(config) + experts_per_token * sum(map(sum, _mlp(config)))


def _mlp(config: GPTConfig, tp: int = 1) -> tuple[list[int], list[int]]:
    """One dense MLP's (matrices, biases): in (SwiGLU: gate and up) and out. An expert is one at TP=1."""
    h, f, f_in = config.hidden_size, config.ffn_hidden_size, config.ffn_input_width
    return [h * f_in // tp, f * h // tp], ([f_in // tp, h] if not config.disable_bias_linear else [])


def _moe_outside_experts(config: GPTConfig, experts: int) -> tuple[list[int], list[int]]:
    """What an MoE layer holds besides its experts, in module order: DeepSpeed's gate (h -> experts, no bias) and,
    for --mlp-type residual, the dense MLP beside the experts and the coefficient (h -> 2) that mixes the two."""
    h = config.hidden_size
    if config.mlp_type != "residual":
        return [h * experts], []
    matrices, biases = _mlp(config)
    return [h * experts, *matrices, 2 * h], [*biases, 2]


def expert_groups_on_rank(config: GPTConfig, expert_parallel_size: int = 1) -> tuple[list[int], list[int]]:
    """Sizes of the expert parameters one rank holds (each MoE layer's experts / EP, each a dense MLP at TP=1), in
    megatron/optimizer.py's groups (matrices; biases), which ZeRO partitions over the expert-data-parallel ranks."""
    matrices, biases = _mlp(config)
    local = [n // expert_parallel_size for n in config.layer_experts if n > 1]
    return [size for n in local for _ in range(n) for size in matrices], \
        [size for n in local for _ in range(n) for size in biases]


def parameter_groups_on_rank(config: GPTConfig, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                             stage: int = 0) -> tuple[list[int], list[int]]:
    """Sizes of the parameters one tensor-parallel rank of pipeline `stage` holds, in module order, in
    megatron/optimizer.py's two groups: (matrices, which decay; biases and LayerNorm weights, which do not).
    Split matrices and their column biases count 1/tp; LayerNorms, row-parallel biases and position
    embeddings are whole on every TP rank (rotary positions have no table). Stage 0 holds the embeddings, the last stage the final
    LayerNorm and (with PP > 1) its own copy of the tied embedding module (the word embedding and an unused
    position table); each stage num_layers / pp layers.
    Llama's shapes: RMSNorm has no bias, --disable-bias-linear drops the linear biases, QKV is h + 2 x the K/V
    width (grouped-query attention), SwiGLU's first matrix 2 ffn wide, and an untied output layer is the last
    stage's own [vocab / tp, h] matrix. An MoE layer's MLP is its gate (and a residual MoE's dense MLP and
    coefficient) here; its experts are expert_groups_on_rank's."""
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    h, qkv = config.hidden_size, config.hidden_size + 2 * config.kv_channels
    words = config.padded_vocab_size // tp * h
    norm = [h] if config.normalization == "rmsnorm" else [h, h]  # weight (and bias)
    bias = not config.disable_bias_linear
    matrices, vectors = [], []
    if stage == 0:
        matrices += [words] + ([config.learned_positions * h] if config.learned_positions else [])
    layers = config.num_layers // pp
    for experts in config.layer_experts[stage * layers:(stage + 1) * layers]:
        # QKV, attention out, MLP in (SwiGLU: gate and up), MLP out
        mlp_matrices, mlp_biases = _mlp(config, tp) if experts == 1 else _moe_outside_experts(config, experts)
        matrices += [h * qkv // tp, h * h // tp, *mlp_matrices]
        # input norm, QKV and attention-out biases, norm, MLP in and out biases
        vectors += norm + ([qkv // tp, h] if bias else []) + norm + mlp_biases
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
