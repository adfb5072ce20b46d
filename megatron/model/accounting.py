"""Parameter counts, FLOPs per iteration, ZeRO memory estimates and accelerator peaks.

The one place these numbers come from: the training log and the analysis both call here.
"""
from __future__ import annotations

import math
import re

from megatron.model.config import GPTConfig

# Dense bf16 tensor-core peaks in TFLOP/s (H100/H200: SXM parts).
PEAK_BF16_TFLOPS: dict[str, float] = {"A40": 149.7, "A100": 312.0, "H100": 989.0, "H200": 989.0}

# ZeRO paper (Rajbhandari et al. 2020), bytes per parameter for (params, grads, optimizer
# states). Mixed precision: 16-bit params and grads, K=12 for fp32 master copy + Adam m + v.
# Pure fp32: the params are their own master copy, so Adam adds only m + v.
_BYTES_PER_PARAM: dict[str, tuple[int, int, int]] = {"fp32": (4, 4, 8), "bf16": (2, 2, 12), "fp16": (2, 2, 12)}


def count_parameters(config: GPTConfig) -> int:
    """Parameters of GPTModel at TP=1, the tied word embedding counted once."""
    h, f = config.hidden_size, config.ffn_hidden_size
    embeddings = (config.padded_vocab_size + config.max_position_embeddings) * h
    attention = (h * 3 * h + 3 * h) + (h * h + h)
    mlp = (h * f + f) + (f * h + h)
    layer_norms = 2 * (2 * h)
    return embeddings + config.num_layers * (attention + mlp + layer_norms) + 2 * h


def parameters_on_rank(config: GPTConfig, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                       stage: int = 0) -> int:
    """Parameters one tensor-parallel rank of pipeline `stage` holds (tensor rank 0 of the first
    stage prints the memory lines). Split matrices and their column biases count 1/tp; LayerNorms,
    row-parallel biases and position embeddings are whole on every TP rank. Stage 0 holds the
    embeddings, the last stage the final LayerNorm and (with PP > 1) its own copy of the tied
    word embedding; each stage num_layers / pp transformer layers."""
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    h, f = config.hidden_size, config.ffn_hidden_size
    attention = (h * 3 * h + 3 * h) // tp + (h * h // tp + h)
    mlp = (h * f + f) // tp + (f * h // tp + h)
    layer = attention + mlp + 2 * (2 * h)
    words = config.padded_vocab_size // tp * h
    total = config.num_layers // pp * layer
    if stage == 0:
        total += words + config.max_position_embeddings * h
    if stage == pp - 1:
        total += 2 * h + (words if pp > 1 else 0)
    return total


def flops_per_iteration(config: GPTConfig, global_batch_size: int, activation_recompute: bool) -> float:
    """72 B s L h^2 (1 + s/(6h) + V/(16 L h)): forward + backward (3x forward) of the dense
    matmuls and attention; full recomputation adds a second forward, x 4/3."""
    b, s, layers, h, v = (
        global_batch_size, config.seq_length, config.num_layers, config.hidden_size, config.padded_vocab_size
    )
    flops = 72.0 * b * s * layers * h * h * (1.0 + s / (6.0 * h) + v / (16.0 * layers * h))
    return flops * 4.0 / 3.0 if activation_recompute else flops


def zero_model_state_estimate(num_params: int, zero_stage: int, dp_size: int, precision: str,
                              offload_optimizer: bool = False, offload_param: bool = False) -> dict[str, int]:
    """Accelerator bytes per rank for params, grads and optimizer states under ZeRO.

    Stage 1 partitions optimizer states over the dp_size ranks, stage 2 also gradients,
    stage 3 also parameters; a partition is ceil(num_params / dp_size) elements (DeepSpeed
    pads to equal partitions). Offloaded states live in host memory and count 0 here.
    """
    if precision not in _BYTES_PER_PARAM:
        raise ValueError(f"precision must be one of {sorted(_BYTES_PER_PARAM)}, got {precision!r}")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"--zero-stage must be 0, 1, 2 or 3, got {zero_stage}")
    if dp_size < 1:
        raise ValueError(f"data-parallel size must be >= 1, got {dp_size}")
    if offload_optimizer and zero_stage == 0:
        raise ValueError("optimizer offload needs --zero-stage 1, 2 or 3")
    if offload_param and zero_stage != 3:
        raise ValueError("parameter offload needs --zero-stage 3")
    param_bytes, grad_bytes, optim_bytes = _BYTES_PER_PARAM[precision]
    partition = math.ceil(num_params / dp_size)
    params = (partition if zero_stage >= 3 else num_params) * param_bytes
    grads = (partition if zero_stage >= 2 else num_params) * grad_bytes
    optim = (partition if zero_stage >= 1 else num_params) * optim_bytes
    if offload_optimizer:
        optim = 0
    if offload_param:
        params = 0
    return dict(params=params, grads=grads, optim=optim, total=params + grads + optim)


def peak_bf16_tflops(device_name: str | None) -> float | None:
    """Dense bf16 peak for an accelerator name such as "NVIDIA H100 80GB HBM3"; None if unknown (CPU)."""
    if not device_name:
        return None
    match = re.search(r"(?<![A-Za-z0-9])(A40|A100|H100|H200)(?![0-9])", device_name.upper())
    return PEAK_BF16_TFLOPS[match.group(1)] if match else None
