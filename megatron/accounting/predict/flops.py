"""FLOPs per iteration (model and hardware) and the accelerators' peaks they are divided by (MFU, HFU)."""
from __future__ import annotations

import re

from megatron.accounting.predict.training_setup import PRECISIONS, AccountingError
from megatron.model.config import GPTConfig
from megatron.model.recipe import layer_recipe, mlp_part

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


def layer_forward_flops(config: GPTConfig, tokens: int, experts: int = 1) -> float:
    """Multiply-adds x 2 of one transformer layer's forward over `tokens` tokens, as its recipe counts them
    (megatron/model/recipe.py): QKV (h -> h + 2 k, k the K/V width: h without grouped-query attention), attention
    out (h -> h), MLP in and out (h -> f -> h; a gated MLP's gate and up are two h -> f), and the attention
    products Q K^T and softmax(.) V, each s x s x h per sequence (the whole square: the causal kernels skip the
    masked half, but Megatron's papers and the counters count it, so the figure stays comparable). An MoE layer
    (`experts` > 1) runs the active MLPs: --topk experts per token, the gate (h -> experts) and, for --mlp-type
    residual, the dense MLP beside them and its coefficient (h -> 2); the capacity's padding is not counted, as the
    dropped tokens are not.
    """
    return layer_recipe(config, experts).forward_flops(tokens)


def logit_forward_flops(config: GPTConfig, tokens: int) -> float:
    """Multiply-adds x 2 of the output layer's forward over `tokens` tokens: h -> V, the padded vocabulary."""
    return 2.0 * tokens * config.hidden_size * config.padded_vocab_size


def model_flops_per_iteration(config: GPTConfig, global_batch_size: int) -> float:
    """Model FLOPs of one training iteration (the MFU numerator): every matmul and attention product of
    the forward, once, and of the backward, twice (input and weight gradients), recomputation not counted:
    3 (L layer + 2 B s h V), V the padded vocabulary of the logit layer. With f = 4h this is
    72 B s L h^2 (1 + s/(6h) + V/(12 L h)) (Narayanan et al. 2021 without their recompute forward).
    Softmax, LayerNorm, GELU, bias adds and the embedding lookups are not matmuls and not counted. MoE layers
    count their active FLOPs per token (layer_forward_flops)."""
    tokens = global_batch_size * config.seq_length
    layers = sum(layer_forward_flops(config, tokens, experts) for experts in config.layer_experts)
    return 3.0 * (layers + logit_forward_flops(config, tokens))


def hardware_flops_per_iteration(config: GPTConfig, global_batch_size: int) -> float:
    """FLOPs the accelerator executes (the HFU numerator, Korthikanti et al. 2022): every layer's
    (layer_hardware_flops: the model FLOPs plus what --checkpoint-activations and --tiled-mlp-compute run again)
    and the logit layer's (output_layer_hardware_flops: never recomputed, but once more with
    --tiled-logits-loss)."""
    tokens = global_batch_size * config.seq_length
    layers = sum(layer_hardware_flops(config, tokens, experts) for experts in config.layer_experts)
    return layers + output_layer_hardware_flops(config, tokens)


def layer_hardware_flops(config: GPTConfig, tokens: int, experts: int = 1) -> float:
    """One layer's FLOPs in a training step over `tokens` tokens: its forward, the backward's two products of it,
    the recompute's (recomputed_forward_flops) and --tiled-mlp-compute's recomputed MLP (tiled_mlp_recompute_flops;
    under --checkpoint-activations the tiled MLP so runs three times)."""
    return (3.0 * layer_forward_flops(config, tokens, experts) + recomputed_forward_flops(config, tokens, experts)
            + tiled_mlp_recompute_flops(config, tokens))


def recomputed_forward_flops(config: GPTConfig, tokens: int, experts: int = 1) -> float:
    """What --checkpoint-activations runs again of one layer's forward over `tokens` tokens in the backward: all
    of it, less the MLP's output matmul (h <- f) where the recompute stops before it (recompute_skips_mlp_output).
    0 without recomputation."""
    if not config.recompute_activations:
        return 0.0
    skipped = 2.0 * tokens * config.ffn_hidden_size * config.hidden_size
    return layer_forward_flops(config, tokens, experts) - (skipped if recompute_skips_mlp_output(config, experts)
                                                           else 0.0)


def recompute_skips_mlp_output(config: GPTConfig, experts: int = 1) -> bool:
    """Whether the recompute of a layer stops before its MLP's output matmul. zero-lab's recompute is torch's
    non-reentrant checkpoint, which stops once it has regenerated every tensor the layer's backward saved; with
    --hidden-dropout 0 the dropout after the MLP is the identity and the residual add saves nothing, so the MLP's
    output is saved by nothing and its matmul is not rerun (the attention's output projection is: the next norm
    saves its sum). Everything is rerun by DeepSpeed's reentrant checkpoint (--deepspeed-activation-checkpointing),
    with hidden dropout (it keeps its mask), in an MoE layer (the experts' combine keeps their outputs) and with
    --tiled-mlp-compute (the tiled MLP runs its whole forward before it saves its input). --checkpoint-in-cpu
    recomputes as without it (tests/test_flops.py counts each case). Not known here: at ZeRO-3 deepspeed.zero.Init
    replaces F.linear process-wide with DeepSpeed's autograd function, which saves its input after its matmul, so
    there the output matmul is rerun too (2 tokens f h a layer more than this counts)."""
    return (not config.recompute_with_deepspeed and config.hidden_dropout == 0.0 and experts == 1
            and not config.tiled_mlp_compute)


def tiled_mlp_recompute_flops(config: GPTConfig, tokens: int) -> float:
    """--tiled-mlp-compute's recomputed forward of one layer's MLP over `tokens` tokens (0 untiled; MoE layers
    are refused with it)."""
    if not config.tiled_mlp_compute:
        return 0.0
    return 2.0 * tokens * config.hidden_size * mlp_part(config).matmul_width(config)


def output_layer_hardware_flops(config: GPTConfig, tokens: int) -> float:
    """The logit layer's FLOPs in a training step over `tokens` tokens: its forward and the backward's two
    products, and tiled (--tiled-logits-loss) the backward's recomputed logits, a fourth."""
    return (4.0 if config.tiled_logits_loss else 3.0) * logit_forward_flops(config, tokens)


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
