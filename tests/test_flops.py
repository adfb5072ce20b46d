"""Model and hardware FLOPs against torch's own count of the real model, and the accelerator peaks."""
import contextlib
from dataclasses import replace

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from megatron.model import GPTConfig, GPTModel
from megatron.accounting import (
    AccountingError,
    accelerator_part,
    hardware_flops_per_iteration,
    matmul_precision,
    model_flops_per_iteration,
    peak_tflops,
)
from megatron.accounting.predict.flops import layer_forward_flops, recompute_skips_mlp_output
from megatron.training_log import memory_line, peak_line


def config(layers, hidden, heads, seq, vocab, ffn=None, recompute=False):
    return GPTConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, seq_length=seq,
                     max_position_embeddings=seq, padded_vocab_size=vocab, ffn_hidden_size=ffn,
                     recompute_activations=recompute)


class MatmulFlops(TorchDispatchMode):
    """torch.utils.flop_counter.FlopCounterMode's count (its flop_registry: mm, addmm, bmm, the attention kernels)
    without its module tracker, which fails on DeepSpeed's TiledMLP (its tiles run under no_grad). `forward`:
    what ran outside the backward."""

    def __init__(self):
        super().__init__()
        self.total = self.forward = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._overloadpacket in flop_registry:
            flops = flop_registry[func._overloadpacket](*args, **(kwargs or {}), out_val=out)
            self.total += flops
            self.forward += flops if torch._C._current_graph_task_id() == -1 else 0
        return out


@contextlib.contextmanager
def torchs_own_linear():
    """F.linear as torch ships it. A ZeRO-3 engine built earlier in this process (deepspeed.zero.Init) replaced it
    process-wide with DeepSpeed's autograd function, which saves its input after its matmul: under it the early-
    stopped recompute also reruns the MLP's output matmul, which the prediction leaves out (its docstring)."""
    patched = torch.nn.functional.linear
    torch.nn.functional.linear = torch._C._nn.linear
    try:
        yield
    finally:
        torch.nn.functional.linear = patched


def count(c: GPTConfig, batch: int) -> MatmulFlops:
    """What torch's FLOP counter counts for one forward and backward of GPTModel on the CPU.

    It counts matmuls (mm, addmm, bmm: 2 m n k each, a bias add not counted) and the fused attention
    kernels of CUDA, but not the CPU's flash-attention kernel; the math backend runs attention as two bmm,
    Q K^T and softmax(.) V over the whole s x s square, which it then counts. Softmax, LayerNorm, GELU,
    dropout and the embedding lookups are not matmuls: neither count includes them. With recomputation
    the backward re-runs what the recompute runs of each layer's forward, and the counter counts that too."""
    torch.manual_seed(0)
    model = GPTModel(c).train()
    tokens = torch.randint(0, c.padded_vocab_size, (batch, c.seq_length))
    positions = torch.arange(c.seq_length).expand(batch, c.seq_length)
    counter = MatmulFlops()
    with sdpa_kernel(SDPBackend.MATH), torchs_own_linear(), counter:
        model(tokens, positions, tokens).sum().backward()
    return counter


def counted_flops(c: GPTConfig, batch: int) -> int:
    return count(c, batch).total


@pytest.mark.parametrize("layers, hidden, heads, seq, vocab, ffn, batch", [
    (2, 64, 4, 32, 256, None, 2),  # FFN 4h
    (3, 48, 3, 24, 200, 100, 3),  # --ffn-hidden-size 100, not 4h
    (1, 32, 2, 64, 128, 48, 1),  # s > h: attention products outweigh the dense layers
    (2, 40, 5, 16, 320, 256, 2),  # FFN wider than 4h, vocabulary larger than the rest
])
@pytest.mark.parametrize("recompute", [False, True])
def test_flops_match_the_counted_model(layers, hidden, heads, seq, vocab, ffn, batch, recompute):
    c = config(layers, hidden, heads, seq, vocab, ffn, recompute)
    counted = counted_flops(c, batch)
    # Both count the same matmuls, so they agree exactly; the tolerance only absorbs float rounding.
    assert hardware_flops_per_iteration(c, batch) == pytest.approx(counted, rel=1e-9)
    if not recompute:
        assert model_flops_per_iteration(c, batch) == pytest.approx(counted, rel=1e-9)


@pytest.mark.parametrize("kv_heads, ffn, untied", [(2, 96, True), (4, None, False), (1, 40, True)])
def test_llama_flops_match_the_counted_model(kv_heads, ffn, untied):
    """SwiGLU's three matrices, grouped-query attention's smaller K/V (its K/V heads repeated for the attention
    products, which stay s x s x h) and the untied output layer, against torch's count of the real model."""
    c = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=kv_heads, seq_length=32,
                  max_position_embeddings=32, padded_vocab_size=256, ffn_hidden_size=ffn, swiglu=True,
                  normalization="rmsnorm", use_rotary_position_embeddings=True, disable_bias_linear=True,
                  untie_embeddings_and_output_weights=untied)
    assert model_flops_per_iteration(c, 2) == pytest.approx(counted_flops(c, 2), rel=1e-9)
    h, f, k, s, tokens = 64, c.ffn_hidden_size, kv_heads * 16, 32, 2 * 32  # written out: 3 passes of the forward
    layer = 2 * tokens * (h * (h + 2 * k) + h * h + 3 * h * f) + 4 * tokens * s * h
    assert model_flops_per_iteration(c, 2) == 3 * (2 * layer + 2 * tokens * h * 256)


def test_recomputation_adds_one_forward_of_the_layers_not_of_the_logit_layer():
    plain, recomputed = config(2, 64, 4, 32, 256), config(2, 64, 4, 32, 256, recompute=True)
    assert model_flops_per_iteration(recomputed, 4) == model_flops_per_iteration(plain, 4)
    layer_forward = 2 * 4 * 32 * 64 * (4 * 64 + 2 * 256) + 4 * 4 * 32 * 32 * 64
    assert hardware_flops_per_iteration(recomputed, 4) - hardware_flops_per_iteration(plain, 4) == 2 * layer_forward
    assert hardware_flops_per_iteration(plain, 4) == model_flops_per_iteration(plain, 4)


# 2 layers whose widths all differ (h 32, QKV 96, f 80, V 64), no dropout unless a case adds it
NO_DROPOUT = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, max_position_embeddings=16,
                       padded_vocab_size=64, ffn_hidden_size=80, hidden_dropout=0.0, attention_dropout=0.0)
LLAMA = dict(swiglu=True, normalization="rmsnorm", num_key_value_heads=2, untie_embeddings_and_output_weights=True,
             disable_bias_linear=True, use_rotary_position_embeddings=True)
RECOMPUTE_CASES = {  # name: (overrides, whether the recompute skips the MLP's output matmul)
    "gelu": ({}, True),
    "attention dropout only": (dict(attention_dropout=0.1), True),
    "hidden dropout": (dict(hidden_dropout=0.1), False),
    "swiglu": (LLAMA, True),
    "swiglu with dropout": (dict(LLAMA, hidden_dropout=0.1, attention_dropout=0.1), False),
    "squared relu": (dict(squared_relu=True), True),
    "checkpoint-in-cpu": (dict(recompute_offload=True), True),
    "checkpoint-in-cpu with dropout": (dict(recompute_offload=True, hidden_dropout=0.1), False),
    "tiled mlp": (dict(tiled_mlp_compute=True, tiled_mlp_shards=4), False),
    "tiled mlp with dropout": (dict(tiled_mlp_compute=True, tiled_mlp_shards=4, hidden_dropout=0.1), False),
}


@pytest.mark.parametrize("case", RECOMPUTE_CASES)
def test_hardware_flops_are_what_the_recompute_runs(case):
    """zero-lab's recompute is torch's non-reentrant checkpoint, which stops once the backward's saved tensors are
    regenerated: without hidden dropout nothing saves the MLP's output, so its h <- f matmul (2 tokens f h) is not
    rerun; with it (its mask), or with the tiled MLP (which saves only after its whole forward), all of the layer
    is. Predicted and counted agree exactly, with and without recomputation."""
    overrides, skips = RECOMPUTE_CASES[case]
    plain = replace(NO_DROPOUT, **overrides)
    recomputed = replace(plain, recompute_activations=True)
    assert recompute_skips_mlp_output(recomputed) == skips
    for c in (plain, recomputed):
        assert hardware_flops_per_iteration(c, 2) == pytest.approx(counted_flops(c, 2), rel=1e-12)
    tokens, forward = 2 * 16, layer_forward_flops(plain, 2 * 16)
    rerun = forward - 2 * tokens * 80 * 32 if skips else forward
    assert hardware_flops_per_iteration(recomputed, 2) - hardware_flops_per_iteration(plain, 2) == 2 * rerun


def _deepspeed_and_moe_recompute(rank):
    """DeepSpeed's reentrant checkpoint reruns the whole layer, dropout or not; so does an MoE layer without dropout
    (the experts' combine keeps their outputs). The MoE count holds DeepSpeed's dispatch and combine einsums, which
    the prediction leaves out: there the counted recompute is checked against the counted forward of the layers."""
    from megatron.core.tensor_parallel.random import configure_deepspeed_checkpointing

    configure_deepspeed_checkpointing(None, {"train_micro_batch_size_per_gpu": 2}, 2, in_cpu=False)
    for dropout in (0.0, 0.1):
        c = replace(NO_DROPOUT, hidden_dropout=dropout, recompute_activations=True, recompute_with_deepspeed=True)
        assert not recompute_skips_mlp_output(c)
        assert hardware_flops_per_iteration(c, 2) == counted_flops(c, 2)
    moe = replace(NO_DROPOUT, num_experts=[2], expert_interval=1)
    plain, recomputed = count(moe, 2), count(replace(moe, recompute_activations=True), 2)
    logits = 2 * 2 * 16 * 32 * 64
    assert recomputed.total - plain.total == plain.forward - logits
    assert not recompute_skips_mlp_output(moe, experts=2)


@pytest.mark.slow  # DeepSpeed's checkpointing and MoE layer ask its communication backend for the rank: one rank
def test_deepspeed_recompute_and_moe_layers_rerun_the_whole_layer():
    from test_parallel_training import _spawned
    from test_upstream_flag_effects import _with_deepspeed_comm, free_port

    torch.multiprocessing.spawn(_spawned, args=(1, free_port(), _with_deepspeed_comm(_deepspeed_and_moe_recompute)),
                                nprocs=1, join=True)


@pytest.mark.parametrize("b, s, layers, h, heads, v, old_low", [
    (32, 1024, 12, 768, 12, 50304, 0.068),  # GPT-2 125M at seq 1024
    (8, 128, 2, 128, 4, 50304, 0.233),  # the CPU tiny preset at seq 128
])
def test_closed_form_and_what_the_old_formula_missed(b, s, layers, h, heads, v, old_low):
    # f = 4h: 72 B s L h^2 (1 + s/(6h) + V/(12 L h)); the logit layer is 6 B s h V (forward 2, backward 4).
    # The old 72 B s L h^2 (1 + s/(6h) + V/(16 L h)) is 6.8% below it for GPT-2 125M, 23% for the tiny preset.
    c = config(layers, h, heads, s, v)
    exact = 72 * b * s * layers * h * h * (1 + s / (6 * h) + v / (12 * layers * h))
    assert model_flops_per_iteration(c, b) == pytest.approx(exact, rel=1e-12)
    old = 72 * b * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))
    assert 1 - old / exact == pytest.approx(old_low, abs=0.001)


@pytest.mark.parametrize("name, part, precision, tf32, peak", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM", "bf16", False, 989.5),
    ("NVIDIA H100 80GB HBM3", "H100 SXM", "fp32", False, 67.0),
    ("NVIDIA H100 80GB HBM3", "H100 SXM", "fp32", True, 494.5),
    ("NVIDIA H100 PCIe", "H100 PCIe", "bf16", False, 756.5),
    ("NVIDIA H100 NVL", "H100 NVL", "fp16", False, 835.5),
    ("NVIDIA H200", "H200 SXM", "bf16", False, 989.5),
    ("NVIDIA H200 NVL", "H200 NVL", "bf16", False, 835.5),
    ("NVIDIA GH200 480GB", "GH200", "bf16", False, 990.0),
    ("Tesla V100-SXM2-32GB", "V100 SXM2", "fp16", False, 125.0),
    ("Tesla V100-SXM2-32GB", "V100 SXM2", "bf16", False, None),  # no bf16 tensor cores
    ("Tesla V100-SXM2-32GB", "V100 SXM2", "fp32", True, 15.7),  # no TF32 either: fp32 runs in fp32
    ("Tesla V100-PCIE-16GB", "V100 PCIe", "fp16", False, 112.0),
    ("NVIDIA A100-SXM4-80GB", "A100", "bf16", False, 312.0),
    ("NVIDIA A100-PCIE-40GB", "A100", "fp32", False, 19.5),
    ("NVIDIA A100-PCIE-40GB", "A100", "fp32", True, 156.0),
    ("NVIDIA A10", "A10", "bf16", False, 125.0),
    ("NVIDIA A40", "A40", "bf16", False, 149.7),
    ("NVIDIA L40S", "L40S", "bf16", False, 362.05),
    ("AMD Instinct MI300X", "MI300X", "bf16", False, 1307.4),
    ("NVIDIA A10G", None, "bf16", False, None),  # not the A10: unknown rather than guessed
    ("NVIDIA RTX A4000", None, "bf16", False, None),
    ("cpu", None, "fp32", False, None),
    (None, None, "bf16", False, None),
])
def test_peaks_per_part_and_precision(name, part, precision, tf32, peak):
    assert accelerator_part(name) == part
    assert peak_tflops(name, precision, tf32) == peak


def test_precision_names():
    assert matmul_precision("fp32", tf32_matmuls=True) == "tf32"
    assert matmul_precision("bf16", tf32_matmuls=True) == "bf16"
    with pytest.raises(AccountingError, match="precision"):
        matmul_precision("fp8", False)


def test_log_lines_carry_mfu_then_hfu_and_say_when_the_peak_is_unknown():
    mem = dict(allocated=0, max_allocated=0, rss=0, max_rss=0)
    assert memory_line(0, "cuda", 10, mem, 40.0, 53.33).endswith(", MFU=40.00%, HFU=53.33% |")
    assert "MFU" not in memory_line(0, "cpu", 10, mem, None, None)
    assert peak_line("cpu", None, "fp32", None) == (
        " > MFU and HFU not reported: 'cpu' (no part known; megatron/accounting/predict/flops.py PEAK_TFLOPS)")
    assert "no bf16 peak known" in peak_line("Tesla V100-SXM2-32GB", "V100 SXM2", "bf16", None)
    assert "dense tf32 peak of A100" in peak_line("NVIDIA A100-SXM4-80GB", "A100", "tf32", 156.0)
