"""Parameter counts, FLOPs per iteration, ZeRO memory estimates and accelerator peaks.

The one place these numbers come from: the training log and the analysis both call here.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from megatron.errors import ZeroLabError
from megatron.model.config import GPTConfig

# Dense peaks in TFLOP/s per accelerator part and matmul precision: bf16/fp16 tensor cores, TF32 tensor
# cores, fp32 without them. Never the sparsity figures: where a datasheet gives only those ("* with
# sparsity", "one-half lower without sparsity") the entry is half of it. A part lacking a precision
# (V100 has no bf16 or TF32 tensor cores) has no entry for it. Sources, the vendors' datasheets:
#   NVIDIA V100 (Tesla V100 datasheet, SXM2 / PCIe; V100S PCIe datasheet): tensor 125 / 112 / 130, fp32 15.7 / 14 / 16.4
#   NVIDIA A100 datasheet (SXM and PCIe, 40 and 80 GB alike): bf16, fp16 312; TF32 156; fp32 19.5
#   NVIDIA A10 datasheet: bf16, fp16 125; TF32 62.5; fp32 31.2
#   NVIDIA A40 datasheet: bf16, fp16 149.7; TF32 74.8; fp32 37.4
#   NVIDIA L40 / L40S datasheets: bf16, fp16 181.05 / 362.05; TF32 90.5 / 183; fp32 90.5 / 91.6
#   NVIDIA H100 datasheet, SXM / PCIe / NVL: bf16, fp16 1979* / 1513* / 1671*; TF32 989* / 756* / 835*;
#     fp32 67 / 51 / 60 (* with sparsity)
#   NVIDIA H200 datasheet, SXM / NVL: as H100 SXM / NVL
#   NVIDIA GH200 Grace Hopper Superchip datasheet (GPU): bf16, fp16 990; TF32 494; fp32 67
#   AMD Instinct MI300X datasheet: bf16, fp16 1307.4; TF32 653.7; fp32 (matrix) 163.4
#   AMD Instinct MI250X datasheet: bf16, fp16 383; fp32 matrix 95.7, per package of two dies; torch sees
#     each die as a device, so half of each here
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "V100 SXM2": {"fp16": 125.0, "fp32": 15.7},
    "V100 PCIe": {"fp16": 112.0, "fp32": 14.0},
    "V100S PCIe": {"fp16": 130.0, "fp32": 16.4},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "A10": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},
    "A40": {"bf16": 149.7, "fp16": 149.7, "tf32": 74.8, "fp32": 37.4},
    "L40": {"bf16": 181.05, "fp16": 181.05, "tf32": 90.5, "fp32": 90.5},
    "L40S": {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6},
    "H100 SXM": {"bf16": 989.5, "fp16": 989.5, "tf32": 494.5, "fp32": 67.0},
    "H100 PCIe": {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.0},
    "H100 NVL": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "H200 SXM": {"bf16": 989.5, "fp16": 989.5, "tf32": 494.5, "fp32": 67.0},
    "H200 NVL": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "GH200": {"bf16": 990.0, "fp16": 990.0, "tf32": 494.0, "fp32": 67.0},
    "MI300X": {"bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4},
    "MI250X die": {"bf16": 191.5, "fp16": 191.5, "fp32": 47.85},
}
# The names torch.cuda.get_device_name reports, upper-cased, to parts; the first match wins. An H100 is
# named by its memory: "NVIDIA H100 80GB HBM3" is the SXM part, the PCIe part "NVIDIA H100 PCIe" (HBM2e);
# the SXM H200 is plain "NVIDIA H200". Anything else is unknown rather than guessed.
_PART_NAMES: tuple[tuple[str, str], ...] = (
    (r"\bV100-SXM2\b", "V100 SXM2"), (r"\bV100-PCIE\b", "V100 PCIe"), (r"\bV100S-PCIE\b", "V100S PCIe"),
    (r"\bA100\b", "A100"), (r"\bA10\b", "A10"), (r"\bA40\b", "A40"), (r"\bL40S\b", "L40S"), (r"\bL40\b", "L40"),
    (r"\bH100 NVL\b", "H100 NVL"), (r"\bH100 PCIE\b", "H100 PCIe"), (r"\bH100 (SXM|\d+GB HBM3\b)", "H100 SXM"),
    (r"\bGH200\b", "GH200"), (r"\bH200 NVL\b", "H200 NVL"), (r"\bH200$|\bH200 (SXM|\d+GB HBM3E\b)", "H200 SXM"),
    (r"\bMI300X\b", "MI300X"), (r"\bMI250X\b", "MI250X die"),
)
PRECISIONS = ("bf16", "fp16", "fp32")

# ZeRO paper (Rajbhandari et al. 2020), bytes per parameter for (params, grads, optimizer
# states). Mixed precision: 16-bit params and grads, K=12 for fp32 master copy + Adam m + v.
# Pure fp32: at stage 0 our optimizer steps the params themselves, so Adam adds only m + v; DeepSpeed's
# ZeRO optimizers (stages 1-3) clone their fp32 master partition even from fp32 params, 4 more bytes
# (stage 3 means to reuse the partition when dtype and device match, but compares a torch.device with
# a device name, which is never equal, in DeepSpeed 0.19.8: measured in tests/test_training.py).
_BYTES_PER_PARAM: dict[str, tuple[int, int, int]] = {"fp32": (4, 4, 8), "bf16": (2, 2, 12), "fp16": (2, 2, 12)}
_FP32_ZERO_MASTER = 4


class AccountingError(ZeroLabError, ValueError):
    """A layout the estimates cannot describe; the message names the flag."""


def count_parameters(config: GPTConfig) -> int:
    """Parameters of GPTModel at TP=1, the tied word embedding counted once."""
    return parameters_on_rank(config)


def parameter_groups_on_rank(config: GPTConfig, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                             stage: int = 0) -> tuple[list[int], list[int]]:
    """Sizes of the parameters one tensor-parallel rank of pipeline `stage` holds, in module order, in
    megatron/optimizer.py's two groups: (matrices, which decay; biases and LayerNorm weights, which do not).
    Split matrices and their column biases count 1/tp; LayerNorms, row-parallel biases and position
    embeddings are whole on every TP rank. Stage 0 holds the embeddings, the last stage the final
    LayerNorm and (with PP > 1) its own copy of the tied word embedding; each stage num_layers / pp layers."""
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    h, f = config.hidden_size, config.ffn_hidden_size
    words = config.padded_vocab_size // tp * h
    matrices, vectors = [], []
    if stage == 0:
        matrices += [words, config.max_position_embeddings * h]
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


def _layer_forward_flops(config: GPTConfig, tokens: int) -> float:
    """Multiply-adds x 2 of one transformer layer's forward over `tokens` tokens: QKV (h -> 3h), attention
    out (h -> h), MLP in and out (h -> f -> h), and the attention products Q K^T and softmax(.) V, each
    s x s x h per sequence (the whole square: the causal kernels skip the masked half, but Megatron's
    papers and the counters count it, so the figure stays comparable)."""
    h, f, s = config.hidden_size, config.ffn_hidden_size, config.seq_length
    return 2.0 * tokens * h * (4 * h + 2 * f) + 4.0 * tokens * s * h


def model_flops_per_iteration(config: GPTConfig, global_batch_size: int) -> float:
    """Model FLOPs of one training iteration (the MFU numerator): every matmul and attention product of
    the forward, once, and of the backward, twice (input and weight gradients), recomputation not counted:
    3 (L layer + 2 B s h V), V the padded vocabulary of the logit layer. With f = 4h this is
    72 B s L h^2 (1 + s/(6h) + V/(12 L h)) (Narayanan et al. 2021 without their recompute forward).
    Softmax, LayerNorm, GELU, bias adds and the embedding lookups are not matmuls and not counted."""
    tokens = global_batch_size * config.seq_length
    logits = 2.0 * tokens * config.hidden_size * config.padded_vocab_size
    return 3.0 * (config.num_layers * _layer_forward_flops(config, tokens) + logits)


def hardware_flops_per_iteration(config: GPTConfig, global_batch_size: int) -> float:
    """FLOPs the accelerator executes (the HFU numerator, Korthikanti et al. 2022): the model FLOPs plus,
    with --checkpoint-activations, a second forward of every transformer layer (the logit layer is not
    recomputed)."""
    flops = model_flops_per_iteration(config, global_batch_size)
    if config.recompute_activations:
        flops += config.num_layers * _layer_forward_flops(config, global_batch_size * config.seq_length)
    return flops


def zero_model_state_estimate(num_params: int, zero_stage: int, dp_size: int, precision: str,
                              offload_optimizer: bool = False, offload_param: bool = False,
                              gradient_elements: int | None = None,
                              gradient_bytes: int | None = None) -> dict[str, int]:
    """Accelerator bytes per rank for params, grads and optimizer states under ZeRO.

    Stage 1 partitions optimizer states over the dp_size ranks, stage 2 also gradients,
    stage 3 also parameters; a partition is ceil(num_params / dp_size) elements (DeepSpeed
    pads to equal partitions). Offloaded states live in host memory and count 0 here.
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
        optim = 0
    if offload_param:
        params = 0
    return dict(params=params, grads=grads, optim=optim, total=params + grads + optim)


def accelerator_part(device_name: str | None) -> str | None:
    """The PEAK_TFLOPS part a device name such as "NVIDIA H100 80GB HBM3" is; None if unknown (CPU)."""
    name = (device_name or "").strip().upper()
    return next((part for pattern, part in _PART_NAMES if re.search(pattern, name)), None)


def matmul_precision(precision: str, tf32_matmuls: bool) -> str:
    """What the matmuls of a run in `precision` (--bf16, --fp16, else fp32) execute in: fp32 runs use the
    TF32 tensor cores only when torch allows it (torch.backends.cuda.matmul.allow_tf32, off by default)."""
    if precision not in PRECISIONS:
        raise AccountingError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    return "tf32" if precision == "fp32" and tf32_matmuls else precision


def peak_tflops(device_name: str | None, precision: str, tf32_matmuls: bool = False) -> float | None:
    """Dense peak TFLOP/s of the named part for a run in `precision`; None if the part or its peak in that
    precision is unknown. A part without TF32 tensor cores runs TF32-allowed fp32 matmuls in fp32."""
    peaks = PEAK_TFLOPS.get(accelerator_part(device_name), {})
    kind = matmul_precision(precision, tf32_matmuls)
    return peaks.get(kind, peaks.get("fp32") if kind == "tf32" else None)


# Bytes of one element of params, grads and activations in each precision.
_ELEMENT_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}
TRAFFIC_KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "p2p")  # as megatron/comm_counter.py


@dataclass(frozen=True)
class TrainingSetup:
    """Everything besides the model shape that the traffic and memory estimates depend on."""
    world_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int = 1
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    sequence_parallel: bool = False
    precision: str = "fp32"
    zero_stage: int = 0
    offload_optimizer: bool = False
    offload_params: bool = False
    offload_device: str = "cpu"  # where offloaded states live: "cpu" or "nvme" (ZeRO-Infinity)
    activation_recompute: bool = False
    # "cuda": fused attention (SDPA's flash or memory-efficient kernel), 1-byte dropout masks; "cpu": SDPA's
    # math kernel with attention dropout (it keeps the attention probabilities), its flash kernel without,
    # masks in the activations' dtype
    device: str = "cuda"

    def __post_init__(self):
        model_parallel = self.tensor_parallel_size * self.pipeline_parallel_size
        if min(self.world_size, self.micro_batch_size, self.gradient_accumulation_steps, model_parallel) < 1:
            raise AccountingError("world size, micro batch, gradient accumulation, TP and PP must all be >= 1")
        if self.world_size % model_parallel:
            raise AccountingError(f"{self.world_size} ranks do not divide into TP={self.tensor_parallel_size} x "
                                  f"PP={self.pipeline_parallel_size}")
        if self.precision not in _ELEMENT_BYTES:
            raise AccountingError(f"precision must be one of {sorted(_ELEMENT_BYTES)}, got {self.precision!r}")
        if self.device not in ("cuda", "cpu"):
            raise AccountingError(f"device must be cuda or cpu, got {self.device!r}")
        if self.offload_device not in ("cpu", "nvme"):
            raise AccountingError(f"offload device must be cpu or nvme, got {self.offload_device!r}")

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // (self.tensor_parallel_size * self.pipeline_parallel_size)

    @property
    def element_bytes(self) -> int:
        return _ELEMENT_BYTES[self.precision]


def _ring_share(group_size: int) -> float:
    """What each of n ranks sends, per byte of the whole buffer, in a reduce-scatter or all-gather."""
    return (group_size - 1) / group_size


def zero_traffic_per_step(config: GPTConfig, setup: TrainingSetup, stage: int = 0) -> dict[str, float]:
    """Bytes one rank of pipeline `stage` sends per optimizer step, per kind of collective, with
    megatron/comm_counter.py's definition of "sent" (docs/zero-tradeoff.md).

    Data parallelism over the rank's P parameters (the ZeRO paper's volumes, in the gradient dtype,
    times (n-1)/n for n data-parallel ranks): stage 0 all-reduces the gradients once per step (2P);
    stage 1 reduces each gradient partition to its owner and all-gathers the updated parameters (P + P),
    except under DeepSpeed's bf16 optimizer (runs_bf16_optimizer), which all-reduces the whole fp32
    gradient buffer, cast to bf16 (DeepSpeed's communication dtype), then all-gathers the updated bf16
    parameters (2P + P; measured on 2 CPU ranks, tests/test_bf16_traffic.py); stage 2 keeps only its
    gradient partition, so it reduces at every micro-batch (g P + P with g micro-batches per step; in
    bf16 its reductions stay bf16, measured, though it keeps an fp32 gradient partition); stage 3
    gathers each parameter for the forward and again for the backward and reduce-scatters the
    gradients, at every micro-batch (3 g P). Tensor parallelism adds four
    all-reduces of a [micro batch, seq, hidden] activation per layer and micro-batch, and one each for
    the embedding's output and the output layer's input (reduce-scatters and all-gathers of the same
    volume under sequence parallelism); pipeline parallelism sends one such activation
    forward and one gradient back per micro-batch, and all-reduces the tied word embedding's gradient
    between the first and last stage."""
    traffic = dict.fromkeys(TRAFFIC_KINDS, 0.0)
    tp, pp, dp, g = (setup.tensor_parallel_size, setup.pipeline_parallel_size, setup.data_parallel_size,
                     setup.gradient_accumulation_steps)
    size = parameters_on_rank(config, tp, pp, stage) * setup.element_bytes
    share = _ring_share(dp) * size
    if setup.zero_stage == 0:
        traffic["all_reduce"] += 2 * share
    elif runs_bf16_optimizer(setup):
        traffic["all_reduce"] += 2 * share
        traffic["all_gather"] += share
    elif setup.zero_stage == 1:
        traffic["reduce_scatter"] += share
        traffic["all_gather"] += share
    elif setup.zero_stage == 2:
        traffic["reduce_scatter"] += g * share
        traffic["all_gather"] += share
    else:
        traffic["reduce_scatter"] += g * share
        traffic["all_gather"] += 2 * g * share
    activation = setup.micro_batch_size * config.seq_length * config.hidden_size * setup.element_bytes
    if tp > 1:
        # 4 per layer, the embedding's output on the first stage, the output layer's input on the last
        all_reduces = 4 * (config.num_layers // pp) + (stage == 0) + (stage == pp - 1)
        per_step = all_reduces * g * 2 * _ring_share(tp) * activation
        if setup.sequence_parallel:
            traffic["reduce_scatter"] += per_step / 2
            traffic["all_gather"] += per_step / 2
        else:
            traffic["all_reduce"] += per_step
    if pp > 1:
        traffic["p2p"] += g * activation / (tp if setup.sequence_parallel else 1) * ((stage > 0) + (stage < pp - 1))
        if stage in (0, pp - 1):
            traffic["all_reduce"] += 2 * _ring_share(2) * config.padded_vocab_size // tp * config.hidden_size \
                * setup.element_bytes
    return traffic


def offload_transfer_per_step(config: GPTConfig, setup: TrainingSetup, stage: int = 0) -> dict[str, float]:
    """Bytes one rank of pipeline `stage` moves per step between accelerator and host ("pcie") and
    between host and NVMe ("nvme") when ZeRO offloads: with the optimizer offloaded, each gradient
    reduction (once per step at stage 1, every micro-batch at 2 and 3) lands in host memory and the
    updated parameter partition comes back; with the parameters offloaded, every gather (forward and
    backward of each micro-batch) reads the partition from the host. On NVMe the optimizer states are
    read and written once per step and parameter partitions read at every gather and written once."""
    partition = math.ceil(parameters_on_rank(config, setup.tensor_parallel_size, setup.pipeline_parallel_size,
                                             stage) / setup.data_parallel_size)
    e, g = setup.element_bytes, setup.gradient_accumulation_steps
    reductions = 1 if setup.zero_stage <= 1 else g
    pcie = nvme = 0.0
    if setup.offload_optimizer:
        pcie += (reductions + 1) * partition * e
    if setup.offload_params:
        pcie += 2 * g * partition * e
    if setup.offload_device == "nvme":
        states = zero_model_state_estimate(partition * setup.data_parallel_size, setup.zero_stage,
                                           setup.data_parallel_size, setup.precision)
        nvme += 2 * states["optim"] if setup.offload_optimizer else 0
        nvme += (2 * g + 1) * partition * e if setup.offload_params else 0
    return dict(pcie=pcie, nvme=nvme)


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
    0.19.8 keeps them (measured by megatron/memory.py; docs/zero-tradeoff.md). Stage 0 keeps every gradient;
    stages 1 and 2 reduce each bucket to its owner and drop the gradients of the parameters outside their
    partition, but keep the whole gradient of every parameter that starts inside it (each optimizer group is
    flattened and cut into dp equal partitions), so a partition that falls inside a large parameter (the
    word embedding) holds all of it; stage 1 reduces only at the last micro-batch, so with accumulation it
    holds every gradient until then; with the optimizer offloaded they keep none (the host does); stage 3
    holds its flat partition. In bf16 the gradients accumulate in fp32 (gradient_bytes_per_element): stage 1's
    bf16 optimizer keeps every gradient, stage 2 an fp32 buffer of exactly its partition of each group."""
    sizes = parameter_groups_on_rank(config, setup.tensor_parallel_size, setup.pipeline_parallel_size, stage)
    every, dp = sum(map(sum, sizes)), setup.data_parallel_size
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


def _layer_activation_bytes(config: GPTConfig, setup: TrainingSetup) -> float:
    """What one transformer layer keeps for the backward of one micro-batch (see activation_bytes)."""
    s, b, h, a = config.seq_length, setup.micro_batch_size, config.hidden_size, config.num_attention_heads
    e, tp, on_cpu = setup.element_bytes, setup.tensor_parallel_size, setup.device == "cpu"
    sequence_split = tp if setup.sequence_parallel else 1
    if on_cpu and config.attention_dropout > 0:
        # SDPA's math kernel (CPU attention with dropout) computes in fp32 whatever the input dtype: fp32
        # copies of q, k, v and the softmax output, its dropout mask and the dropped probabilities (a s^2 b)
        attention_inputs, attention = 3 * 4, a * s * s * b * 3 * 4 / tp
    else:
        # a fused kernel (CUDA, or CPU without attention dropout) keeps q, k, v (views of the QKV output), its
        # output (laid out so that it is the output projection's input, counted below) and an fp32 log-sum-exp
        attention_inputs, attention = 3 * e, 4 * a * s * b / tp
    mask = _dropout_mask_bytes(config, setup)
    norm_statistics = e if on_cpu else 4  # LayerNorm's mean and 1/std: the input's dtype on CPU, fp32 on CUDA
    # split over TP: the attention inputs, the attention output projection's input (e), the MLP's GeLU
    # input and output (8e)
    split = s * b * h * (attention_inputs + 9 * e) / tp
    # whole on every TP rank: the QKV and MLP inputs (the LayerNorms' outputs; under sequence parallelism
    # the column-parallel layers keep the gathered input, not their slice)
    whole = s * b * h * 2 * e
    # replicated unless sequence parallel: both LayerNorms' inputs, the two residual dropout masks, both
    # LayerNorms' mean and 1/std per token
    replicated = (s * b * h * (2 * e + 2 * mask) + 2 * 2 * norm_statistics * s * b) / sequence_split
    return split + whole + replicated + attention


def activation_bytes(config: GPTConfig, setup: TrainingSetup, stage: int = 0) -> int:
    """Bytes autograd keeps from the forward for the backward on one rank of pipeline `stage` (what
    megatron/memory.py's saved_activation_bytes measures), for this model's kernels; the per-layer terms
    follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"),
    s b h (34 + 5 a s / h) in 16-bit with 1-byte masks and unfused attention. On CPU SDPA's math kernel
    keeps the a s^2 b attention probabilities when there is attention dropout; a fused kernel (CUDA, or
    CPU without attention dropout) keeps only a log-sum-exp. Without dropout no masks are kept.
    Outside the layers: the token and position ids and the embedding's dropout mask on the first stage;
    the final LayerNorm's input and statistics, the output layer's input, the labels and the loss's
    per-token sums on the last. Full recomputation keeps each layer's input instead of its activations
    (memory_per_rank adds the one layer recomputed at a time). Under 1F1B the first stage holds pp
    micro-batches in flight, the last one."""
    s, b, h = config.seq_length, setup.micro_batch_size, config.hidden_size
    e, on_cpu = setup.element_bytes, setup.device == "cpu"
    sequence_split = setup.tensor_parallel_size if setup.sequence_parallel else 1
    layers = config.num_layers // setup.pipeline_parallel_size
    if setup.activation_recompute:
        per_micro = layers * s * b * h * e / sequence_split
    else:
        per_micro = layers * _layer_activation_bytes(config, setup)
    if stage == 0:  # int64 token and position ids, the embedding's dropout mask
        per_micro += 2 * 8 * s * b + s * b * h * _dropout_mask_bytes(config, setup) / sequence_split
    if stage == setup.pipeline_parallel_size - 1:
        # final LayerNorm input (e) and statistics; the output layer's input (e, gathered under sequence
        # parallelism); int64 labels, a 1-byte "label outside this vocabulary slice" flag and an fp32 sum of
        # exponentials per token
        norm_statistics = 2 * (e if on_cpu else 4)
        per_micro += (s * b * h * e + norm_statistics * s * b) / sequence_split + s * b * h * e + s * b * (8 + 1 + 4)
    in_flight = min(setup.pipeline_parallel_size - stage, setup.gradient_accumulation_steps)
    return int(per_micro * max(1, in_flight))


def output_layer_buffer_bytes(config: GPTConfig, setup: TrainingSetup) -> int:
    """The [micro batch x seq, vocab / tp] buffer of the fused output-layer loss on the last stage
    (megatron/core/tensor_parallel/cross_entropy.py): fp32 exps that become the logits' gradient,
    plus the 16-bit logits (then their 16-bit gradient, in the same reused buffer) in bf16/fp16."""
    vocab_slice = config.padded_vocab_size // setup.tensor_parallel_size
    rows_by_vocab = setup.micro_batch_size * config.seq_length * vocab_slice
    return rows_by_vocab * (4 + (setup.element_bytes if setup.element_bytes != 4 else 0))


def memory_per_rank(config: GPTConfig, setup: TrainingSetup, stage: int = 0) -> dict[str, int]:
    """Accelerator bytes one rank of pipeline `stage` needs: ZeRO model states (params, grads as DeepSpeed
    keeps them, optimizer states and their total; offloaded ones count 0), activations, the output-layer
    buffer (last stage only) and their total (the peak, with the one layer recomputed at a time under
    full recomputation); and the bytes offloaded to host memory or NVMe: the offloaded states, and with
    the optimizer offloaded the fp32 gradient partition it steps with."""
    on_rank = parameters_on_rank(config, setup.tensor_parallel_size, setup.pipeline_parallel_size, stage)
    args = (on_rank, setup.zero_stage, setup.data_parallel_size, setup.precision)
    held = dict(gradient_elements=gradient_elements_held(config, setup, stage),
                gradient_bytes=gradient_bytes_per_element(setup))
    states = zero_model_state_estimate(*args, setup.offload_optimizer, setup.offload_params, **held)
    offloaded = zero_model_state_estimate(*args, **held)["total"] - states["total"]
    if setup.offload_optimizer:  # the optimizer steps on the host: an fp32 copy of the gradient partition there
        offloaded += math.ceil(on_rank / setup.data_parallel_size) * 4
    activations = activation_bytes(config, setup, stage)
    recomputed = int(_layer_activation_bytes(config, setup)) if setup.activation_recompute else 0
    buffer = output_layer_buffer_bytes(config, setup) if stage == setup.pipeline_parallel_size - 1 else 0
    return dict(params=states["params"], grads=states["grads"], optim=states["optim"], model_states=states["total"],
                activations=activations, output_buffer=buffer,
                total=states["total"] + activations + recomputed + buffer,
                offloaded=offloaded)
