"""Bytes a rank holds: ZeRO model states (as DeepSpeed 0.19.8 keeps them), activations, the output buffer."""
from __future__ import annotations

import math

from megatron.accounting.predict.parameters import expert_groups_on_rank, parameter_groups_on_rank, parameters_on_rank
from megatron.accounting.predict.training_setup import AccountingError, TrainingSetup
from megatron.model.config import GPTConfig
from megatron.model.recipe import mlp_part, norm_part
from megatron.model.tiling import loss_tiles, mlp_tiles

# ZeRO paper (Rajbhandari et al. 2020), bytes per parameter for (params, grads, optimizer
# states). Mixed precision: 16-bit params and grads, K=12 for fp32 master copy + Adam m + v.
# Pure fp32: at stage 0 our optimizer steps the params themselves, so Adam adds only m + v; DeepSpeed's
# ZeRO optimizers (stages 1-3) clone their fp32 master partition even from fp32 params, 4 more bytes
# (stage 3 means to reuse the partition when dtype and device match, but compares a torch.device with
# a device name, which is never equal, in DeepSpeed 0.19.8: measured in tests/test_training.py).
_BYTES_PER_PARAM: dict[str, tuple[int, int, int]] = {"fp32": (4, 4, 8), "bf16": (2, 2, 12), "fp16": (2, 2, 12)}
_FP32_ZERO_MASTER = 4



def zero_model_state_estimate(num_params: int, zero_stage: int, dp_size: int, precision: str,
                              offload_optimizer: bool = False, offload_param: bool = False,
                              gradient_elements: int | None = None,
                              gradient_bytes: int | None = None) -> dict[str, int]:
    """Accelerator bytes per rank for params, grads and optimizer states under ZeRO.

    Stage 1 partitions optimizer states over the dp_size ranks, stage 2 also gradients,
    stage 3 also parameters; a partition is ceil(num_params / dp_size) elements (DeepSpeed
    pads to equal partitions). Offloaded states live in host memory and count 0 here; with the optimizer
    offloaded so do the gradients (DeepSpeed 0.19.8 copies each reduced gradient partition to host memory:
    stages 1 and 2 into the fp32 partition's gradient, stage 3 into a pinned accumulation buffer, its
    grad_partitions_flat_buffer; the accelerator keeps only the reduce buckets, which are not counted).
    gradient_elements: the gradients a rank really keeps (gradient_elements_held: DeepSpeed keeps more
    than the paper's partition at stages 1 and 2); by default the paper's. gradient_bytes: the bytes each of
    them takes (gradient_bytes_per_element: fp32 accumulation); by default the paper's 16-bit.
    """
    if precision not in _BYTES_PER_PARAM:
        raise AccountingError(f"precision must be one of {sorted(_BYTES_PER_PARAM)}, got {precision!r}")
    if zero_stage not in (0, 1, 2, 3):
        raise AccountingError(f"--zero-stage must be 0, 1, 2 or 3, got {zero_stage}")
    if dp_size < 1:
        raise AccountingError(f"data-parallel size must be >= 1, got {dp_size}")
    if offload_optimizer and zero_stage == 0:
        raise AccountingError("optimizer offload needs --zero-stage 1, 2 or 3")
    if offload_param and zero_stage != 3:
        raise AccountingError("parameter offload needs --zero-stage 3")
    param_bytes, grad_bytes, optim_bytes = _BYTES_PER_PARAM[precision]
    if precision == "fp32" and zero_stage >= 1:
        optim_bytes += _FP32_ZERO_MASTER
    partition = math.ceil(num_params / dp_size)
    params = (partition if zero_stage >= 3 else num_params) * param_bytes
    if gradient_elements is None:
        gradient_elements = partition if zero_stage >= 2 else num_params
    grads = gradient_elements * (grad_bytes if gradient_bytes is None else gradient_bytes)
    optim = (partition if zero_stage >= 1 else num_params) * optim_bytes
    if offload_optimizer:
        optim = grads = 0
    if offload_param:
        params = 0
    return dict(params=params, grads=grads, optim=optim, total=params + grads + optim)


def _whole_parameters_of_first_partition(sizes: list[int], dp_size: int) -> int:
    """Elements of the parameters that start inside data-parallel rank 0's partition of one flattened group."""
    partition = math.ceil(sum(sizes) / dp_size)
    held = start = 0
    for size in sizes:
        if start >= partition:
            break
        held, start = held + size, start + size
    return held


def gradient_elements_held(config: GPTConfig, setup: TrainingSetup, stage: int = 0) -> int:
    """Gradient elements the logging rank (data-parallel rank 0) holds at its peak in a step, as DeepSpeed
    0.19.8 keeps them (measured by megatron/accounting/measure/memory.py; docs/zero-tradeoff-reference.md). Stage 0
    keeps every gradient;
    stages 1 and 2 reduce each bucket to its owner and drop the gradients of the parameters outside their
    partition, but keep the whole gradient of every parameter that starts inside it (each optimizer group is
    flattened and cut into dp equal partitions), so a partition that falls inside a large parameter (the
    word embedding) holds all of it; stage 1 reduces only at the last micro-batch, so with accumulation it
    holds every gradient until then; with the optimizer offloaded they keep none (the host's fp32 gradient
    partition does). MoE: the experts are groups of their own (megatron/optimizer.py's moe_param_groups), under
    the same rule over the expert-data-parallel ranks. Stage 3 holds its flat partition, in host memory with the
    optimizer offloaded (zero_model_state_estimate counts it off the accelerator). In bf16 the gradients
    accumulate in fp32 (gradient_bytes_per_element): stage 1's bf16 optimizer keeps every gradient, stage 2 an
    fp32 buffer of exactly its partition of each group."""
    sizes = parameter_groups_on_rank(config, setup.tensor_parallel_size, setup.pipeline_parallel_size, stage)
    dense = _gradient_elements_of_groups(sizes, setup.zero_partitions, setup)
    return dense + expert_gradient_elements_held(config, setup)


def expert_gradient_elements_held(config: GPTConfig, setup: TrainingSetup) -> int:
    """The expert gradients among gradient_elements_held's."""
    experts = [group for group in expert_groups_on_rank(config, setup.expert_parallel_size) if group]
    return _gradient_elements_of_groups(experts, setup.expert_data_parallel_size, setup) if experts else 0


def _gradient_elements_of_groups(sizes: list[list[int]], dp: int, setup: TrainingSetup) -> int:
    """gradient_elements_held's rule for optimizer groups of these sizes, partitioned over dp ranks."""
    every = sum(map(sum, sizes))
    if setup.offload_optimizer and setup.zero_stage in (1, 2):
        return 0  # each reduced bucket goes straight to the host's fp32 gradient partition
    if setup.zero_stage == 0 or (setup.zero_stage == 1 and (setup.gradient_accumulation_steps > 1
                                                           or setup.precision == "bf16")):
        return every
    if setup.zero_stage == 3:
        return math.ceil(every / dp)
    if setup.precision == "bf16":
        return sum(math.ceil(sum(group) / dp) for group in sizes)
    return sum(_whole_parameters_of_first_partition(group, dp) for group in sizes)


def runs_bf16_optimizer(setup: TrainingSetup) -> bool:
    """Whether DeepSpeed 0.19.8 steps with its BF16_Optimizer instead of the ZeRO-1 one: bf16 parameters with
    gradients accumulated in fp32 (megatron/deepspeed_config.py asks for it in bf16 at stages 1-3) at stage 1
    without offload (engine._do_optimizer_sanity_check)."""
    return setup.precision == "bf16" and setup.zero_stage == 1 and not setup.offload_optimizer


def gradient_bytes_per_element(setup: TrainingSetup) -> int:
    """Bytes a held gradient element takes. In bf16 at stages 1-3 DeepSpeed accumulates the micro-batches'
    gradients in fp32 (megatron/deepspeed_config.py asks for it; DeepSpeed 0.19.8 refuses it at stage 0): stages
    2 and 3 keep an fp32 partition, stage 1 (DeepSpeed's bf16 optimizer) an fp32 buffer of every gradient beside
    the bf16 gradients, 6 bytes each. Otherwise the gradients are in the parameters' dtype."""
    if setup.precision != "bf16" or setup.zero_stage == 0:
        return setup.element_bytes
    if runs_bf16_optimizer(setup):
        return 2 + 4
    return 4


def _dropout_mask_bytes(config: GPTConfig, setup: TrainingSetup) -> int:
    """Bytes per element of a residual dropout mask: none without dropout; the input's dtype on CPU,
    1 byte (bool) on CUDA."""
    if config.hidden_dropout == 0:
        return 0
    return setup.element_bytes if setup.device == "cpu" else 1


def fused_attention(config: GPTConfig, setup: TrainingSetup) -> bool:
    """Whether the model's attention (one SDPA call, megatron/model/transformer.py) runs a fused kernel, which keeps
    no s x s tensor: on CUDA always (flash, cuDNN or memory-efficient, tests/test_gpu.py); on CPU only without
    attention dropout, since PyTorch's CPU flash kernel has none and SDPA falls back to its math kernel."""
    return setup.device != "cpu" or config.attention_dropout == 0


def _fused_attention_inputs(config: GPTConfig, setup: TrainingSetup) -> int:
    """[tokens, hidden] tensors a fused attention kernel (CUDA, or CPU without attention dropout) keeps of its
    inputs, with the kernel's output where it is not the output projection's input (measured on CPU,
    tests/test_memory.py). Under Ulysses q, k and v are the all-to-alls' outputs, tensors of their own whatever
    rotary or grouped-query attention made before them."""
    rotary = config.use_rotary_position_embeddings
    multi_head = config.num_key_value_heads == config.num_attention_heads
    if setup.sequence_parallel_size > 1 or (multi_head and not rotary):
        return 3  # q, k and v are views of the QKV output, and the kernel's output is the projection's input
    # q and k rotated into copies, or q sliced out of the K/V groups and K/V repeated to every head: three
    # tensors of their own. Rotated q is [b, a, s, d], and so is the kernel's output: a copy feeds the projection
    kept = 3 + (1 if rotary else 0)
    # multi-head with rotary: v is still a view of the QKV output, which stays whole (3 hidden) beside q and k
    return kept + (2 if multi_head else 0)


def _norm_bytes(config: GPTConfig, setup: TrainingSetup) -> tuple[int, int]:
    """(bytes per element, bytes per token) one norm keeps: the recipe's norm's (megatron/model/recipe.py)."""
    return norm_part(config).activation_bytes(setup.element_bytes, setup.device == "cpu")


def _layer_activation_bytes(config: GPTConfig, setup: TrainingSetup) -> float:
    """What one transformer layer keeps for the backward of one micro-batch (see activation_bytes)."""
    s, b, h, a = config.seq_length, setup.micro_batch_size, config.hidden_size, config.num_attention_heads
    e, tp = setup.element_bytes, setup.tensor_parallel_size
    n = setup.sequence_parallel_size
    t = s / n  # tokens of each sequence on this rank: under Ulysses every activation outside attention holds s/N
    sequence_split = tp if setup.sequence_parallel else 1
    if not fused_attention(config, setup):
        # SDPA's math kernel (CPU attention with dropout) computes in fp32 whatever the input dtype: fp32
        # copies of q, k, v (K/V repeated to every head) and the softmax output, its dropout mask and the dropped
        # probabilities (a s^2 b; under Ulysses the whole sequence's for a/N heads)
        attention_inputs, attention = 3 * 4, a * s * s * b * 3 * 4 / tp / n
    else:
        # a fused kernel (CUDA, or CPU without attention dropout) keeps q, k, v and an fp32 log-sum-exp
        # (_fused_attention_inputs). Under Ulysses q, k and v are the all-to-all's [s, a/N] outputs (t h elements
        # each, as before) and the kernel's output is a tensor of its own beside the projection's input that the
        # reverse all-to-all makes
        attention_inputs = _fused_attention_inputs(config, setup) * e
        attention = 4 * a * t * b / tp + (t * b * h * e / tp if n > 1 else 0)
    if config.use_rotary_position_embeddings:  # the fp32 cos and sin of the rank's t positions the layer rotates by
        attention += 2 * t * config.rotary_dim * 4
    mask = _dropout_mask_bytes(config, setup)
    norm_element, norm_token = _norm_bytes(config, setup)
    # split over TP: the attention inputs, the attention output projection's input (e), the MLP's [tokens, ffn]
    # tensors (the recipe's MLP says how many: GELU's input and output, a gated MLP's four; none tiled, whose
    # backward recomputes them a tile at a time: tiled_mlp_peak_bytes)
    mlp = 0 if config.tiled_mlp_compute else mlp_part(config).kept_ffn_tensors * config.ffn_hidden_size * e
    split = t * b * (h * (attention_inputs + e) + mlp) / tp
    # whole on every TP rank: the QKV and MLP inputs (the norms' outputs; under sequence parallelism
    # the column-parallel layers keep the gathered input, not their slice, but the tiled MLP keeps its slice)
    whole = t * b * h * e * (1 + (1 / sequence_split if config.tiled_mlp_compute else 1))
    # replicated unless sequence parallel: what both norms keep (_norm_bytes), the two residual dropout masks
    replicated = (t * b * h * 2 * (norm_element + mask) + 2 * norm_token * t * b) / sequence_split
    return split + whole + replicated + attention


def activation_bytes(config: GPTConfig, setup: TrainingSetup, stage: int = 0) -> int:
    """Bytes autograd keeps from the forward for the backward on one rank of pipeline `stage` (what
    megatron/accounting/measure/memory.py's saved_activation_bytes measures), for this model's kernels; the per-layer
    terms
    follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"),
    s b h (34 + 5 a s / h) in 16-bit with 1-byte masks and unfused attention. On CPU SDPA's math kernel
    keeps the a s^2 b attention probabilities when there is attention dropout; a fused kernel (CUDA, or
    CPU without attention dropout) keeps only a log-sum-exp. Without dropout no masks are kept.
    Outside the layers: the token and position ids and the embedding's dropout mask on the first stage;
    the final LayerNorm's input and statistics, the output layer's input, the labels and the loss's
    per-token sums on the last. Full recomputation keeps each layer's input instead of its activations
    (memory_per_rank adds the one layer recomputed at a time), and with --checkpoint-in-cpu not even that: the
    inputs are in host memory (offloaded_activation_bytes). Under 1F1B the first stage holds pp
    micro-batches in flight, the last one. Under DeepSpeed-Ulysses (setup.sequence_parallel_size N) each rank
    keeps s/N tokens of everything outside the attention, and inside it the whole sequence for a/N heads, plus
    under a fused kernel the attention output before the reverse all-to-all (s b h / N more per layer); the
    all-to-alls keep nothing (measured on 2 CPU ranks, tests/test_memory.py)."""
    s, b, h = config.seq_length // setup.sequence_parallel_size, setup.micro_batch_size, config.hidden_size
    e = setup.element_bytes
    sequence_split = setup.tensor_parallel_size if setup.sequence_parallel else 1
    layers = config.num_layers // setup.pipeline_parallel_size
    if setup.activation_recompute:  # with --checkpoint-in-cpu the inputs are in host memory instead
        per_micro = 0 if setup.activation_offload else layers * layer_input_bytes(config, setup)
    else:
        per_micro = layers * _layer_activation_bytes(config, setup)
    if stage == 0:  # int64 token ids and position ids (a learned table's lookup only), the embedding's dropout mask
        ids = 2 if config.learned_positions else 1
        per_micro += ids * 8 * s * b + s * b * h * _dropout_mask_bytes(config, setup) / sequence_split
    if stage == setup.pipeline_parallel_size - 1:
        # what the final norm keeps (_norm_bytes); the output layer's input (e, gathered under sequence
        # parallelism); int64 labels, a 1-byte "label outside this vocabulary slice" flag and an fp32 sum of
        # exponentials per token, and tiled (--tiled-logits-loss) the fp32 max logit its backward recomputes from
        norm_element, norm_token = _norm_bytes(config, setup)
        final_norm = (s * b * h * norm_element + norm_token * s * b) / sequence_split
        per_micro += final_norm + s * b * h * e + s * b * (8 + 1 + 4 + (4 if config.tiled_logits_loss else 0))
    return int(per_micro * _in_flight(setup, stage))


def _in_flight(setup: TrainingSetup, stage: int) -> int:
    """Micro-batches whose activations a rank of `stage` holds at once: under 1F1B pp - stage, else one."""
    return max(1, min(setup.pipeline_parallel_size - stage, setup.gradient_accumulation_steps))


def layer_input_bytes(config: GPTConfig, setup: TrainingSetup) -> float:
    """One layer's input for one micro-batch, [s/N, b, h] (split over TP under sequence parallelism): what full
    recomputation keeps of the layer until its backward."""
    sequence_split = setup.tensor_parallel_size if setup.sequence_parallel else 1
    tokens = config.seq_length // setup.sequence_parallel_size * setup.micro_batch_size
    return tokens * config.hidden_size * setup.element_bytes / sequence_split


def offloaded_activation_bytes(config: GPTConfig, setup: TrainingSetup, stage: int = 0) -> int:
    """Host bytes --checkpoint-in-cpu keeps on one rank of pipeline `stage` (setup.activation_offload): every
    layer's input of each micro-batch in flight, moved out in the forward, back for the layer's recompute
    (megatron/core/tensor_parallel/activation_offload.py; what memory.host_tier_bytes measures)."""
    if not setup.activation_offload:
        return 0
    layers = config.num_layers // setup.pipeline_parallel_size
    return int(layers * layer_input_bytes(config, setup) * _in_flight(setup, stage))


def output_layer_buffer_bytes(config: GPTConfig, setup: TrainingSetup) -> int:
    """The [micro batch x seq, vocab / tp] buffer of the fused output-layer loss on the last stage
    (megatron/core/tensor_parallel/cross_entropy.py): fp32 exps that become the logits' gradient,
    plus the 16-bit logits (then their 16-bit gradient, in the same reused buffer) in bf16/fp16; under
    DeepSpeed-Ulysses the rank's s/N positions only; tiled (--tiled-logits-loss), one tile's rows."""
    vocab_slice = config.padded_vocab_size // setup.tensor_parallel_size
    rows = setup.micro_batch_size * config.seq_length // setup.sequence_parallel_size
    rows = math.ceil(rows / loss_tiles(config, rows, vocab_slice))
    return rows * vocab_slice * (4 + (setup.element_bytes if setup.element_bytes != 4 else 0))


def _mlp_call_tokens(config: GPTConfig, setup: TrainingSetup) -> int:
    """Tokens one call of the MLP's matmuls sees: the rank's s/N x b (gathered over TP under --sequence-parallel);
    tiled (--tiled-mlp-compute), one tile's."""
    s, b, tp = config.seq_length // setup.sequence_parallel_size, setup.micro_batch_size, setup.tensor_parallel_size
    local = s // tp if setup.sequence_parallel else s  # each TP rank's tokens of a sequence
    rows = math.ceil(b * local / mlp_tiles(config, b, local))
    return rows * tp if setup.sequence_parallel else rows


def tiled_mlp_peak_bytes(config: GPTConfig, setup: TrainingSetup) -> int:
    """--tiled-mlp-compute: what the backward's recompute of one MLP tile keeps at a time on top of the
    activations (megatron/model/tiling.py): the tile's [tokens, ffn] tensors (the recipe's MLP says how many),
    split over TP, and under --sequence-parallel the tile's input gathered over the TP ranks; 0 untiled."""
    if not config.tiled_mlp_compute:
        return 0
    e, tp = setup.element_bytes, setup.tensor_parallel_size
    ffn = mlp_part(config).kept_ffn_tensors * config.ffn_hidden_size * e / tp
    gathered = config.hidden_size * e if setup.sequence_parallel and tp > 1 else 0
    return int(_mlp_call_tokens(config, setup) * (ffn + gathered))


def backward_gradient_bytes(config: GPTConfig, setup: TrainingSetup) -> int:
    """The gradients the backward holds beside the activations at its peak, in one layer: the MLP's, that of its
    first matmul's [tokens, ffn] output (GELU's ffn wide, a gated MLP's 2 ffn; split over TP; one tile's under
    --tiled-mlp-compute), or the attention's, two [t, h] gradients of q, k and v (three under Ulysses, whose
    all-to-alls copy them), whichever is larger. Fitted to the peak of live bytes measured on CPU ranks in every
    combination of Ulysses, recompute, tiling and offload (tests/test_long_sequence_levers.py): without it the
    untiled peak was 9-13% above the total and the tiled one up to 13% above, with it within 7%."""
    tp = setup.tensor_parallel_size
    mlp = _mlp_call_tokens(config, setup) * mlp_part(config).input_width(config) // tp * setup.element_bytes
    attention = (3 if setup.sequence_parallel_size > 1 else 2) * layer_input_bytes(config, setup)
    return int(max(mlp, attention))


def tied_output_gradient_bytes(config: GPTConfig, setup: TrainingSetup) -> int:
    """The output layer's [vocab / tp, h] weight gradient autograd holds through the whole backward when the output
    layer shares the word embeddings' weight (GPT-2's tied output, without a pipeline): the loss's backward makes it
    first, and autograd keeps it until the embeddings' backward makes theirs and adds the two into the parameter's
    gradient. 0 untied (--untie-embeddings-and-output-weights) or under a pipeline, where the first and the last stage
    each hold their own copy of the weight and each gradient becomes that copy's .grad at once."""
    if config.untie_embeddings_and_output_weights or setup.pipeline_parallel_size > 1:
        return 0
    return config.padded_vocab_size // setup.tensor_parallel_size * config.hidden_size * setup.element_bytes


def embedding_backward_bytes(config: GPTConfig, setup: TrainingSetup, output_buffer: int) -> int:
    """What the backward holds when it reaches a tied word embedding (tied_output_gradient_bytes, else 0), the layers'
    activations freed by then: the output layer's held weight gradient and the embedding's dense [vocab / tp, h] one
    before autograd adds them (their sum becomes the parameter's .grad, a model state), the gradient of the
    embeddings' [t, b, h] output, the saved token (and position) ids, and on CPU ranks the logits buffer, which the
    model keeps to the step's end (megatron/core/scratch.py). GPT-2's vocabulary on the tiny preset (seq 128,
    micro-batch 4, fp32): 98.3 + 2 x 24.6 + 0.3 MiB, measured 147.6 (tests/test_tied_embedding_memory.py).
    memory_per_rank takes the larger of this and the layers' phase. The held gradient is live in the layers' phase
    too, but is not added there: at the byte vocabulary the layers' fitted terms (backward_gradient_bytes) already
    cover it, and with it the DeepSpeed-Ulysses grid's tiled cells come out 13% over what they measure
    (tests/test_long_sequence_levers.py)."""
    held = tied_output_gradient_bytes(config, setup)
    if not held:
        return 0
    tokens = config.seq_length // setup.sequence_parallel_size * setup.micro_batch_size
    ids = (2 if config.learned_positions else 1) * 8 * tokens
    kept_buffer = output_buffer if setup.device == "cpu" else 0
    return 2 * held + tokens * config.hidden_size * setup.element_bytes + ids + kept_buffer


def memory_per_rank(config: GPTConfig, setup: TrainingSetup, stage: int = 0) -> dict[str, int]:
    """Accelerator bytes one rank of pipeline `stage` needs: ZeRO model states (params, grads as DeepSpeed
    keeps them, optimizer states and their total; offloaded ones count 0), activations, the output-layer
    buffer (last stage only) and their total (the peak, with the one layer recomputed at a time under
    full recomputation, its input copied back from host memory under --checkpoint-in-cpu, the one MLP tile
    under --tiled-mlp-compute, tiled_mlp_peak_bytes, and the backward's gradients, backward_gradient_bytes; with a
    tied output layer, the embedding's backward instead where it holds more, embedding_backward_bytes);
    the layer inputs --checkpoint-in-cpu keeps in host memory (activations_offloaded); and the bytes offloaded to host memory or NVMe: the offloaded states, and with the
    optimizer offloaded the fp32 gradient partition it steps with and, at stage 3, the gradient partition it
    accumulates in host memory. MoE: the rank's experts (each MoE layer's / EP) under the same ZeRO stage over
    the expert-data-parallel ranks (DP / EP), the rest over the data-parallel ones."""
    on_rank = parameters_on_rank(config, setup.tensor_parallel_size, setup.pipeline_parallel_size, stage)
    experts = sum(map(sum, expert_groups_on_rank(config, setup.expert_parallel_size)))
    every = gradient_elements_held(config, setup, stage)
    expert_held = expert_gradient_elements_held(config, setup)
    states, offloaded = _model_states(on_rank, setup.zero_partitions, every - expert_held, setup)
    if experts:  # ZeRO partitions them over the expert-data-parallel ranks
        expert_states, expert_offloaded = _model_states(experts, setup.expert_data_parallel_size, expert_held, setup)
        states = {key: states[key] + expert_states[key] for key in states}
        offloaded += expert_offloaded
    activations = activation_bytes(config, setup, stage)
    recomputed = int(_layer_activation_bytes(config, setup)) if setup.activation_recompute else 0
    if setup.activation_offload:  # the recomputed layer's input, copied back from host memory
        recomputed += int(layer_input_bytes(config, setup))
    recomputed += tiled_mlp_peak_bytes(config, setup) + backward_gradient_bytes(config, setup)
    buffer = output_layer_buffer_bytes(config, setup) if stage == setup.pipeline_parallel_size - 1 else 0
    # the layers' phase or, with a tied output layer, the embedding's backward (embedding_backward_bytes)
    peak = max(activations + recomputed + buffer, embedding_backward_bytes(config, setup, buffer))
    return dict(params=states["params"], grads=states["grads"], optim=states["optim"], model_states=states["total"],
                activations=activations, output_buffer=buffer, total=states["total"] + peak,
                offloaded=offloaded, activations_offloaded=offloaded_activation_bytes(config, setup, stage))


def _model_states(on_rank: int, partitions: int, gradient_elements: int,
                  setup: TrainingSetup) -> tuple[dict[str, int], int]:
    """(zero_model_state_estimate on the accelerator, bytes offloaded) of `on_rank` parameters over `partitions`."""
    args = (on_rank, setup.zero_stage, partitions, setup.precision)
    held = dict(gradient_elements=gradient_elements, gradient_bytes=gradient_bytes_per_element(setup))
    states = zero_model_state_estimate(*args, setup.offload_optimizer, setup.offload_params, **held)
    offloaded = zero_model_state_estimate(*args, **held)["total"] - states["total"]
    if setup.offload_optimizer:  # the optimizer steps on the host: an fp32 copy of the gradient partition there
        offloaded += math.ceil(on_rank / partitions) * 4
    return states, offloaded


def checkpoint_bytes(num_params: int, precision: str, zero_stage: int) -> int:
    """Bytes one checkpoint takes on disk, all ranks together: the parameters in the run's precision and the
    optimizer states (fp32 master copy where there is one, Adam's m and v), the model states with the gradients
    left out, however ZeRO partitions them. The tiny preset's fp32 ZeRO-1 save: 6.85M parameters x 16 bytes,
    109.5 MB on disk (27.4 MB of model states, 2 x 41.1 MB of optimizer partitions)."""
    states = zero_model_state_estimate(num_params, zero_stage, 1, precision)
    return states["params"] + states["optim"]


# megatron/checkpointing/rng.py's generators as a checkpoint holds them: torch's CPU generator state (5,056 bytes)
# and numpy's MT19937 key as 624 int64s (CUDA's generator states add 16 bytes per GPU, not counted)
RNG_STATE_BYTES = 5056 + 624 * 8
_ZERO_ALIGNMENT = 2  # DeepSpeed 0.19.8 pads a stage 1-2 group to 2 x dp elements (nccl_start_alignment_factor)


def async_save_copy_bytes(config: GPTConfig, setup: TrainingSetup, stage: int = 0) -> int:
    """Host bytes data-parallel rank 0 of pipeline `stage` holds for --async-save (megatron/checkpointing/
    async_save.py): a copy of every tensor of the files it writes, kept from the first save to the run's end. Its
    model-states file: the module's weights in the run's dtype (at ZeRO-3 DeepSpeed 0.19.8's module state dict
    holds empty tensors: every weight is in the ZeRO files) and the client state's generators; at ZeRO-0 the
    optimizer's Adam m and v there too, with a step per parameter. Its ZeRO file: each optimizer group's partition
    (stages 1-2: the flattened group padded to 2 x dp elements and split; stage 3: each parameter split) as fp32
    master weights and Adam's m and v, with one fp32 step per group. Its own generators' file. Gradients are not
    saved: none are copied."""
    # bytes per optimizer element: Adam's m and v, and at stages 1-3 the fp32 master (fp32: 8, then 12)
    per_element = zero_model_state_estimate(1, setup.zero_stage, 1, setup.precision)["optim"]
    module = 0 if setup.zero_stage == 3 else parameters_on_rank(
        config, setup.tensor_parallel_size, setup.pipeline_parallel_size, stage) * setup.element_bytes
    groups = [(group, setup.zero_partitions) for group in
              parameter_groups_on_rank(config, setup.tensor_parallel_size, setup.pipeline_parallel_size, stage)]
    groups += [(group, setup.expert_data_parallel_size)
               for group in expert_groups_on_rank(config, setup.expert_parallel_size)]
    groups = [(group, dp) for group, dp in groups if group]
    if setup.zero_stage == 0:  # torch's Adam: a step per parameter
        optim = sum(sum(group) * per_element + 4 * len(group) for group, _ in groups)
    else:
        optim = sum(_partition_elements(group, dp, setup.zero_stage) * per_element + 4 for group, dp in groups)
    return module + optim + 2 * RNG_STATE_BYTES


def _partition_elements(group: list[int], dp: int, zero_stage: int) -> int:
    """Elements of one rank's partition of an optimizer group, as DeepSpeed 0.19.8 pads and splits it."""
    if zero_stage == 3:
        return sum(math.ceil(size / dp) for size in group)
    align = _ZERO_ALIGNMENT * dp
    return math.ceil(sum(group) / align) * align // dp
