"""FLOPs, ZeRO model-state estimates and accelerator peaks, against hand-computed values."""
import pytest

from megatron.model import GPTConfig
from megatron.model.accounting import (
    PEAK_BF16_TFLOPS,
    count_parameters,
    flops_per_iteration,
    peak_bf16_tflops,
    zero_model_state_estimate,
)


def config(**overrides):
    fields = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=128,
                  max_position_embeddings=128, padded_vocab_size=512)
    fields.update(overrides)
    return GPTConfig(**fields)


def test_flops_hand_computed():
    # 72 * B * s * L * h^2 * (1 + s/(6h) + V/(16 L h)), B=8 s=128 L=2 h=64 V=512:
    # 72*8*128*2*4096 = 603,979,776;  1 + 128/384 + 512/2048 = 1.5833...  -> 956,301,312
    assert flops_per_iteration(config(), global_batch_size=8, activation_recompute=False) == pytest.approx(956_301_312)
    assert flops_per_iteration(config(), 8, activation_recompute=True) == pytest.approx(956_301_312 * 4 / 3)


def test_flops_gpt2_125m_order_of_magnitude():
    # 6 * N * tokens is the usual rough count; the exact formula adds attention, so it is a bit higher.
    c = config(num_layers=12, hidden_size=768, num_attention_heads=12, seq_length=1024,
               max_position_embeddings=1024, padded_vocab_size=50304)
    flops = flops_per_iteration(c, global_batch_size=32, activation_recompute=False)
    rough = 6 * count_parameters(c) * 32 * 1024
    assert rough < flops < 1.35 * rough


def test_flops_scale_linearly_with_batch():
    c = config()
    assert flops_per_iteration(c, 16, False) == pytest.approx(2 * flops_per_iteration(c, 8, False))


PSI = 1_000_000  # parameters
ND = 4  # data-parallel ranks


@pytest.mark.parametrize(
    "stage, expected",
    [
        # mixed precision, ZeRO paper: params 2 Psi, grads 2 Psi, optimizer K Psi with K = 12
        (0, dict(params=2 * PSI, grads=2 * PSI, optim=12 * PSI)),
        (1, dict(params=2 * PSI, grads=2 * PSI, optim=12 * PSI // ND)),
        (2, dict(params=2 * PSI, grads=2 * PSI // ND, optim=12 * PSI // ND)),
        (3, dict(params=2 * PSI // ND, grads=2 * PSI // ND, optim=12 * PSI // ND)),
    ],
)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_zero_estimate_mixed_precision(stage, expected, precision):
    estimate = zero_model_state_estimate(PSI, stage, ND, precision)
    assert estimate == dict(expected, total=sum(expected.values()))


@pytest.mark.parametrize(
    "stage, expected",
    [
        # fp32 training: 4-byte params and grads, Adam m and v (8 bytes); no separate master copy
        (0, dict(params=4 * PSI, grads=4 * PSI, optim=8 * PSI)),
        (1, dict(params=4 * PSI, grads=4 * PSI, optim=8 * PSI // ND)),
        (2, dict(params=4 * PSI, grads=4 * PSI // ND, optim=8 * PSI // ND)),
        (3, dict(params=4 * PSI // ND, grads=4 * PSI // ND, optim=8 * PSI // ND)),
    ],
)
def test_zero_estimate_fp32(stage, expected):
    estimate = zero_model_state_estimate(PSI, stage, ND, "fp32")
    assert estimate == dict(expected, total=sum(expected.values()))


def test_zero_paper_example_7_5b_on_64_ranks():
    # ZeRO paper Figure 1: Psi = 7.5B, Nd = 64, K = 12 -> 120 GB, 31.4 GB, 16.6 GB, 1.88 GB per device.
    totals = [zero_model_state_estimate(7_500_000_000, s, 64, "bf16")["total"] / 1e9 for s in range(4)]
    assert totals == pytest.approx([120.0, 31.4, 16.6, 1.88], abs=0.05)  # as printed, 3 digits


def test_zero_estimate_pads_uneven_partitions():
    assert zero_model_state_estimate(10, 3, 4, "fp32") == dict(params=12, grads=12, optim=24, total=48)


def test_zero_estimate_offload():
    assert zero_model_state_estimate(PSI, 2, 2, "bf16", offload_optimizer=True) == dict(
        params=2 * PSI, grads=PSI, optim=0, total=3 * PSI)
    assert zero_model_state_estimate(PSI, 3, 2, "bf16", offload_optimizer=True, offload_param=True) == dict(
        params=0, grads=PSI, optim=0, total=PSI)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(zero_stage=4), "--zero-stage must be 0, 1, 2 or 3, got 4"),
        (dict(precision="fp8"), "precision must be one of ['bf16', 'fp16', 'fp32'], got 'fp8'"),
        (dict(dp_size=0), "data-parallel size must be >= 1, got 0"),
        (dict(zero_stage=2, offload_param=True), "parameter offload needs --zero-stage 3"),
        (dict(zero_stage=0, offload_optimizer=True), "optimizer offload needs --zero-stage 1, 2 or 3"),
    ],
)
def test_zero_estimate_errors(kwargs, message):
    args = dict(num_params=PSI, zero_stage=1, dp_size=2, precision="bf16")
    args.update(kwargs)
    with pytest.raises(ValueError) as error:
        zero_model_state_estimate(**args)
    assert str(error.value) == message


def test_peak_table():
    assert PEAK_BF16_TFLOPS == {"A40": 149.7, "A100": 312.0, "H100": 989.0, "H200": 989.0}


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100-PCIE-40GB", 312.0),
        ("NVIDIA A40", 149.7),
        ("NVIDIA RTX A4000", None),
        ("cpu", None),
        ("", None),
        (None, None),
    ],
)
def test_peak_lookup(name, peak):
    assert peak_bf16_tflops(name) == peak
