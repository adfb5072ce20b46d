"""FLOPs, ZeRO model-state estimates and accelerator peaks, against hand-computed values."""
import math
from dataclasses import replace

import pytest

from megatron.model import GPTConfig
from megatron.accounting import (
    AccountingError,
    TrainingSetup,
    activation_bytes,
    count_parameters,
    gradient_elements_held,
    memory_per_rank,
    output_layer_buffer_bytes,
    parameter_groups_on_rank,
    parameters_on_rank,
    zero_traffic_per_step,
    model_flops_per_iteration,
    zero_model_state_estimate,
)


def config(**overrides):
    fields = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=128,
                  max_position_embeddings=128, padded_vocab_size=512)
    fields.update(overrides)
    return GPTConfig(**fields)


def test_flops_hand_computed():
    # 3 (L (2 B s h (4h + 2f) + 4 B s^2 h) + 2 B s h V), B=8 s=128 L=2 h=64 f=256 V=512:
    # layer 2*1024*64*768 + 4*1024*128*64 = 100,663,296 + 33,554,432; logits 2*1024*64*512 = 67,108,864
    # 3 * (2 * 134,217,728 + 67,108,864) = 1,006,632,960 (more FLOPs: tests/test_flops.py)
    assert model_flops_per_iteration(config(), global_batch_size=8) == pytest.approx(1_006_632_960)


def test_flops_gpt2_125m_order_of_magnitude():
    # 6 * N * tokens is the usual rough count; the exact formula adds attention, so it is a bit higher.
    c = config(num_layers=12, hidden_size=768, num_attention_heads=12, seq_length=1024,
               max_position_embeddings=1024, padded_vocab_size=50304)
    flops = model_flops_per_iteration(c, global_batch_size=32)
    rough = 6 * count_parameters(c) * 32 * 1024
    assert rough < flops < 1.35 * rough


def test_flops_scale_linearly_with_batch():
    c = config()
    assert model_flops_per_iteration(c, 16) == pytest.approx(2 * model_flops_per_iteration(c, 8))


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
        # fp32 training: 4-byte params and grads, Adam m and v (8 bytes); under ZeRO also the fp32
        # master partition DeepSpeed clones from the params
        (0, dict(params=4 * PSI, grads=4 * PSI, optim=8 * PSI)),
        (1, dict(params=4 * PSI, grads=4 * PSI, optim=12 * PSI // ND)),
        (2, dict(params=4 * PSI, grads=4 * PSI // ND, optim=12 * PSI // ND)),
        (3, dict(params=4 * PSI // ND, grads=4 * PSI // ND, optim=12 * PSI // ND)),
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
    assert zero_model_state_estimate(10, 3, 4, "fp32") == dict(params=12, grads=12, optim=36, total=60)
    assert zero_model_state_estimate(10, 1, 4, "fp32") == dict(params=40, grads=40, optim=36, total=116)


def test_zero_estimate_offload():
    """With the optimizer offloaded DeepSpeed copies each reduced gradient partition to host memory, at stage 3
    too: the accelerator keeps the parameters, and with them offloaded nothing."""
    assert zero_model_state_estimate(PSI, 2, 2, "bf16", offload_optimizer=True) == dict(
        params=2 * PSI, grads=0, optim=0, total=2 * PSI)
    assert zero_model_state_estimate(PSI, 3, 2, "bf16", offload_optimizer=True) == dict(
        params=PSI, grads=0, optim=0, total=PSI)
    assert zero_model_state_estimate(PSI, 3, 2, "bf16", offload_optimizer=True, offload_param=True) == dict(
        params=0, grads=0, optim=0, total=0)


@pytest.mark.parametrize("precision, grad_bytes", [("bf16", 4), ("fp32", 4), ("fp16", 2)])
def test_stage_3_offload_counts_its_gradients_on_the_host(precision, grad_bytes):
    """Stage 3 accumulates its gradient partition in the accumulation dtype (fp32 in bf16), on the accelerator
    without offload; with the optimizer offloaded in pinned host memory, where the host optimizer also keeps an
    fp32 gradient of its master partition: both count offloaded, neither on the accelerator."""
    c = config()
    partition = math.ceil(count_parameters(c) / 2)
    param_bytes = {"bf16": 2, "fp16": 2, "fp32": 4}[precision]
    optim_bytes = 12  # fp32 master, Adam m and v (DeepSpeed clones the master from fp32 parameters too)

    def memory(**offload):
        return memory_per_rank(c, TrainingSetup(world_size=2, micro_batch_size=2, precision=precision,
                                                zero_stage=3, **offload))
    on_gpu = memory()
    assert (on_gpu["grads"], on_gpu["offloaded"]) == (grad_bytes * partition, 0)
    assert on_gpu["model_states"] == (param_bytes + grad_bytes + optim_bytes) * partition
    host_grads = (grad_bytes + 4) * partition
    optimizer = memory(offload_optimizer=True)
    assert (optimizer["grads"], optimizer["optim"], optimizer["model_states"]) == (0, 0, param_bytes * partition)
    assert optimizer["offloaded"] == optim_bytes * partition + host_grads
    assert optimizer["total"] == on_gpu["total"] - (grad_bytes + optim_bytes) * partition
    everything = memory(offload_optimizer=True, offload_params=True)
    assert everything["model_states"] == 0
    assert everything["offloaded"] == (param_bytes + optim_bytes) * partition + host_grads


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
    with pytest.raises(AccountingError) as error:
        zero_model_state_estimate(**args)
    assert str(error.value) == message


# ---- traffic per step (megatron/accounting/measure/comm_counter.py's "bytes sent": (n-1)/n of the buffer per pass)
# ----------

def traffic(stage, world=2, accumulation=1, precision="fp32", **setup):
    c = config(**setup.pop("model", {}))
    run = TrainingSetup(world_size=world, micro_batch_size=2, gradient_accumulation_steps=accumulation,
                        precision=precision, zero_stage=stage, **setup)
    return c, zero_traffic_per_step(c, run)


@pytest.mark.parametrize("world", [2, 8])
def test_traffic_is_the_zero_papers_volumes_without_accumulation(world):
    """ZeRO paper section 7: DP, stage 1 and stage 2 move 2 Psi per step, stage 3 3 Psi (x (n-1)/n)."""
    c, dp = traffic(0, world)
    share = (world - 1) / world * count_parameters(c) * 4
    assert dp == dict(all_reduce=2 * share, reduce_scatter=0.0, all_gather=0.0, broadcast=0.0, p2p=0.0)
    assert traffic(1, world)[1] == dict(dp, all_reduce=0.0, reduce_scatter=share, all_gather=share)
    assert traffic(2, world)[1] == traffic(1, world)[1]
    assert traffic(3, world)[1] == dict(dp, all_reduce=0.0, reduce_scatter=share, all_gather=2 * share)
    assert sum(traffic(3, world)[1].values()) == pytest.approx(1.5 * sum(dp.values()))


def test_traffic_with_gradient_accumulation():
    """Stage 0/1 reduce once per step; stage 2 holds only its gradient partition, so it reduces at every
    micro-batch; stage 3 also gathers the parameters at every micro-batch."""
    c, _ = traffic(0)
    psi = count_parameters(c) * 4 / 2  # (n-1)/n = 1/2 of the fp32 model, per pass
    totals = {stage: sum(traffic(stage, accumulation=4)[1].values()) / psi for stage in range(4)}
    assert totals == {0: 2.0, 1: 2.0, 2: 5.0, 3: 12.0}


def test_bf16_stage_1_all_reduces_then_all_gathers():
    """bf16 at stage 1 runs DeepSpeed's bf16 optimizer (the gradients accumulate in fp32): an all-reduce of every
    gradient, cast to bf16, then an all-gather of the updated bf16 parameters, once per step whatever the
    accumulation (measured: tests/test_bf16_traffic.py). With the optimizer offloaded DeepSpeed keeps its ZeRO-1
    optimizer, and stage 2 reduces in bf16 as before."""
    c, fp32 = traffic(1)
    share = 0.5 * count_parameters(c) * 2  # (n-1)/n of the bf16 model, per pass
    for accumulation in (1, 4):
        assert traffic(1, accumulation=accumulation, precision="bf16")[1] == dict(
            fp32, all_reduce=2 * share, reduce_scatter=0.0, all_gather=share)
    assert traffic(1, precision="bf16", offload_optimizer=True)[1] == dict(fp32, reduce_scatter=share,
                                                                           all_gather=share)
    assert traffic(2, precision="bf16")[1] == dict(fp32, reduce_scatter=share, all_gather=share)
    assert traffic(1, precision="fp16")[1] == traffic(2, precision="fp16")[1]


def test_gradients_reduced_in_their_communication_dtype():
    """A DeepSpeed JSON's communication_data_type (TrainingSetup.reduce_precision) sets the gradients' bytes; the
    parameters' gathers stay in the parameters' dtype."""
    c, bf16 = traffic(2, precision="bf16")
    _, fp32_grads = traffic(2, precision="bf16", reduce_precision="fp32")
    assert fp32_grads == dict(bf16, reduce_scatter=2 * bf16["reduce_scatter"])
    assert traffic(3, reduce_precision="bf16")[1]["reduce_scatter"] == traffic(3)[1]["reduce_scatter"] / 2
    with pytest.raises(AccountingError, match="reduce_precision must be one of"):
        TrainingSetup(world_size=2, micro_batch_size=1, reduce_precision="fp8")


def test_traffic_in_16_bit_halves():
    assert sum(traffic(3, precision="bf16")[1].values()) == pytest.approx(sum(traffic(3)[1].values()) / 2)


def test_traffic_tensor_and_pipeline_parallel():
    c = config()
    act = 2 * 128 * 64 * 4  # micro batch x seq x hidden x fp32
    tp = zero_traffic_per_step(c, TrainingSetup(world_size=4, micro_batch_size=2, tensor_parallel_size=2,
                                                zero_stage=1))
    share = 0.5 * parameters_on_rank(c, 2) * 4
    # ZeRO over 2 data-parallel ranks of this rank's half of the matrices; over TP 4 all-reduces a layer,
    # one for the embedding's output and one for the output layer's input (measured on 2 CPU ranks)
    assert tp["reduce_scatter"] == tp["all_gather"] == share
    assert tp["all_reduce"] == (4 * 2 + 2) * 2 * 0.5 * act
    sp = zero_traffic_per_step(c, TrainingSetup(world_size=4, micro_batch_size=2, tensor_parallel_size=2,
                                                sequence_parallel=True, zero_stage=1))
    assert sp["all_reduce"] == 0.0
    assert sp["reduce_scatter"] + sp["all_gather"] == pytest.approx(2 * share + tp["all_reduce"])
    pp = TrainingSetup(world_size=4, micro_batch_size=2, gradient_accumulation_steps=3, pipeline_parallel_size=2)
    last = zero_traffic_per_step(c, pp, stage=1)
    embedding_grad = 2 * 0.5 * 512 * 64 * 4
    assert last["p2p"] == 3 * act  # one activation gradient sent back per micro-batch
    assert last["all_reduce"] == pytest.approx(2 * 0.5 * parameters_on_rank(c, 1, 2, 1) * 4 + embedding_grad)


# ---- memory per rank -------------------------------------------------------------------------------------

def _per_layer(c, **setup) -> float:
    """One layer's activations: the difference a layer makes to the whole (the embedding and loss terms cancel)."""
    more = config(**{**c.to_dict(), "num_layers": 2 * c.num_layers})
    run = TrainingSetup(**setup)
    return (activation_bytes(more, run) - activation_bytes(c, run)) / c.num_layers


def test_activations_per_layer_on_cuda():
    """Korthikanti et al. 2022's s b h (34 + 5 a s / h) per layer in 16-bit, for fused attention: no a s^2 b
    probabilities but an fp32 log-sum-exp (4 a s b); fp32 LayerNorm statistics (2 x 8 bytes per token)."""
    c = config(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=512, max_position_embeddings=512)
    s, b, h, a = 512, 2, 256, 8
    assert _per_layer(c, world_size=1, micro_batch_size=b, precision="bf16") == pytest.approx(
        s * b * h * 34 + 4 * a * s * b + 16 * s * b)
    # TP t: Korthikanti's 10 + 24 / t, the log-sum-exp split
    assert _per_layer(c, world_size=2, micro_batch_size=b, precision="bf16", tensor_parallel_size=2) == pytest.approx(
        s * b * h * (10 + 24 / 2) + 4 * a * s * b / 2 + 16 * s * b)
    # sequence parallelism splits the LayerNorm inputs, the masks and the statistics too; the column-parallel
    # layers keep their gathered input (the QKV and MLP inputs, 4 bytes per sbh element)
    assert _per_layer(c, world_size=2, micro_batch_size=b, precision="bf16", tensor_parallel_size=2,
                      sequence_parallel=True) == pytest.approx(
        s * b * h * 4 + (s * b * h * 30 + 4 * a * s * b + 16 * s * b) / 2)
    # full recomputation keeps each layer's input
    assert _per_layer(c, world_size=1, micro_batch_size=b, precision="bf16",
                      activation_recompute=True) == pytest.approx(2 * s * b * h)


def test_activations_per_layer_on_cpu():
    """SDPA's math kernel on CPU: fp32 q, k, v copies and three fp32 a s^2 b tensors whatever the dtype;
    dropout masks and LayerNorm statistics in the activations' dtype (megatron/accounting/measure/memory.py measures it:
    tests/test_memory.py)."""
    c = config(num_layers=2, hidden_size=128, num_attention_heads=4, seq_length=64, max_position_embeddings=64)
    s, b, h, a = 64, 4, 128, 4
    assert _per_layer(c, world_size=1, micro_batch_size=b, device="cpu") == pytest.approx(
        s * b * h * (12 + 36 + 16 + 8) + a * s * s * b * 12 + 16 * s * b)
    assert _per_layer(c, world_size=1, micro_batch_size=b, device="cpu", precision="bf16") == pytest.approx(
        s * b * h * (12 + 18 + 8 + 4) + a * s * s * b * 12 + 8 * s * b)


def test_activations_in_flight_under_1f1b():
    c = config(num_layers=4)
    one = activation_bytes(c, TrainingSetup(world_size=2, micro_batch_size=2, gradient_accumulation_steps=4))
    pipe = TrainingSetup(world_size=2, micro_batch_size=2, gradient_accumulation_steps=4, pipeline_parallel_size=2)
    first, last = activation_bytes(c, pipe, 0), activation_bytes(c, pipe, 1)
    assert first > 1.5 * last  # the first stage holds 2 micro-batches of its 2 layers, the last one of its 2
    assert first / 2 + last == pytest.approx(one, rel=0.01)


def test_output_layer_buffer():
    c = config()
    assert output_layer_buffer_bytes(c, TrainingSetup(world_size=2, micro_batch_size=2)) == 2 * 128 * 512 * 4
    assert output_layer_buffer_bytes(c, TrainingSetup(world_size=2, micro_batch_size=2, precision="bf16",
                                                      tensor_parallel_size=2)) == 2 * 128 * 256 * (4 + 2)


def _parameters_of_the_real_model(c: GPTConfig) -> int:
    import torch

    from megatron.model import GPTModel
    torch.manual_seed(0)
    return sum(p.numel() for p in GPTModel(c).parameters())


# bytes per parameter of (params, grads, optimizer states): fp32 Adam keeps m and v (8); DeepSpeed's ZeRO optimizers
# also clone an fp32 master partition (4) even from fp32 params (measured: tests/test_training.py); mixed
# precision is the ZeRO paper's 2 + 2 + K, K = 12, but at stage 3 the gradients accumulate in fp32 (4; measured:
# tests/test_gpu_numerics.py)
@pytest.mark.parametrize("precision, stage, per_param, partitioned", [
    ("fp32", 0, 4 + 4 + 8, 1), ("fp32", 3, 4 + 4 + 4 + 8, 2), ("bf16", 0, 2 + 2 + 12, 1), ("bf16", 3, 2 + 4 + 12, 2)])
def test_memory_per_rank_by_hand(precision, stage, per_param, partitioned):
    """memory_per_rank for 2 layers, hidden 64, 4 heads, seq 128, vocab 512, micro-batch 2, 2 ranks on CUDA,
    every term written out. Model states: the real module's parameters times the bytes each keeps, over the
    ranks at stage 3. Activations per layer, Korthikanti et al. 2022: 34 s b h bytes in 16-bit are 16 two-byte
    tensors and 2 one-byte dropout masks, so 16 e + 2 for e-byte elements; fused attention keeps an fp32
    log-sum-exp (4 a s b) instead of the a s^2 b probabilities; two LayerNorms keep an fp32 mean and 1/std
    (16 s b). Outside the layers: int64 token and position ids (16 s b), the embedding's dropout mask (s b h);
    the final LayerNorm's input (e s b h) and statistics (8 s b), the output layer's input (e s b h), int64
    labels, a 1-byte flag and an fp32 sum per token (13 s b). The output layer's buffer: fp32 exps over
    [b s, vocab], plus the 16-bit logits in bf16. At the backward's peak, the gradient of one MLP's [s b, 4h]."""
    c = config()
    n = _parameters_of_the_real_model(c)
    assert n == 2 * (12 * 64 * 64 + 13 * 64) + (512 + 128) * 64 + 2 * 64 == 141_056
    s, b, h, a, e = 128, 2, 64, 4, {"fp32": 4, "bf16": 2}[precision]
    per_layer = (16 * e + 2) * s * b * h + 4 * a * s * b + 16 * s * b
    outside = 16 * s * b + s * b * h + e * s * b * h + 8 * s * b + e * s * b * h + 13 * s * b
    buffer = b * s * 512 * (4 + (2 if precision == "bf16" else 0))
    gradient = e * s * b * 4 * h  # the backward's gradient of the MLP's [s b, 4h] at the peak
    model_states = per_param * n // partitioned
    memory = memory_per_rank(c, TrainingSetup(world_size=2, micro_batch_size=b, precision=precision,
                                              zero_stage=stage))
    assert (memory["model_states"], memory["activations"], memory["output_buffer"]) == (
        model_states, 2 * per_layer + outside, buffer)
    assert memory["total"] == model_states + 2 * per_layer + outside + buffer + gradient
    if precision == "fp32":
        assert memory["total"] == {0: 5_379_328, 3: 4_532_992}[stage]  # the sums, for the record
    # full recomputation keeps each layer's input (e s b h) and recomputes one layer at a time
    recompute = memory_per_rank(c, TrainingSetup(world_size=2, micro_batch_size=b, precision=precision,
                                                 zero_stage=stage, activation_recompute=True))
    assert recompute["activations"] == 2 * e * s * b * h + outside
    assert recompute["total"] == model_states + 2 * e * s * b * h + outside + per_layer + buffer + gradient


def test_gradients_held_by_deepspeed():
    """Stages 1-2 keep the whole gradient of every parameter starting in data-parallel rank 0's partition of each
    optimizer group (matrices, then vectors); stage 1 keeps every gradient while it accumulates."""
    c = config()
    matrices, vectors = parameter_groups_on_rank(c)
    assert sum(matrices) + sum(vectors) == count_parameters(c)
    words = c.padded_vocab_size * c.hidden_size
    assert matrices[0] == words and len(vectors) == 8 * c.num_layers + 2

    def held(stage, dp, accumulation=1):
        return gradient_elements_held(c, TrainingSetup(world_size=dp, micro_batch_size=1, zero_stage=stage,
                                                       gradient_accumulation_steps=accumulation))
    half = sum(matrices) / 2
    first_matrices = sum(m for i, m in enumerate(matrices) if sum(matrices[:i]) < half)
    first_vectors = sum(v for i, v in enumerate(vectors) if sum(vectors[:i]) < sum(vectors) / 2)
    assert held(2, 2) == held(1, 2) == first_matrices + first_vectors
    assert held(1, 2, accumulation=2) == held(0, 2) == count_parameters(c)
    assert held(3, 2) == math.ceil(count_parameters(c) / 2)
    assert held(2, 1) == count_parameters(c)


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=6, tensor_parallel_size=4), "6 ranks do not divide into TP=4 x PP=1 x SP=1"),
    (dict(world_size=4, tensor_parallel_size=2, sequence_parallel_size=4), "4 ranks do not divide into TP=2 x PP=1 x SP=4"),
    (dict(world_size=2, precision="fp8"), "precision must be one of ['bf16', 'fp16', 'fp32'], got 'fp8'"),
    (dict(world_size=0), "world size, micro batch, gradient accumulation, TP, PP and SP must all be >= 1"),
])
def test_training_setup_errors(kwargs, message):
    with pytest.raises(AccountingError) as error:
        TrainingSetup(micro_batch_size=1, **kwargs)
    assert str(error.value) == message


def test_ulysses_ranks_are_no_replicas_but_zero_partitions_over_them():
    """8 ranks at TP=2 x SP=2: two replicas read different samples; ZeRO partitions over the 4 ranks holding the
    same parameters, so the model states are those of 4 data-parallel ranks without Ulysses."""
    c = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=256, max_position_embeddings=256,
                  padded_vocab_size=512)
    ulysses = TrainingSetup(world_size=8, micro_batch_size=1, tensor_parallel_size=2, sequence_parallel_size=2,
                            zero_stage=3)
    assert (ulysses.data_parallel_size, ulysses.zero_partitions) == (2, 4)
    replicas = TrainingSetup(world_size=4, micro_batch_size=1, tensor_parallel_size=1, zero_stage=3)
    model_states = ("params", "grads", "optim", "offloaded")
    tp4 = replace(replicas, world_size=8, tensor_parallel_size=2)
    assert [memory_per_rank(c, ulysses)[k] for k in model_states] == [memory_per_rank(c, tp4)[k] for k in model_states]
    assert zero_traffic_per_step(c, ulysses)["all_gather"] == zero_traffic_per_step(c, tp4)["all_gather"]
    # TP's all-reduces carry the rank's 128 tokens, those of a sequence half as long without Ulysses
    half = replace(c, seq_length=128)
    assert zero_traffic_per_step(c, ulysses)["all_reduce"] == zero_traffic_per_step(half, tp4)["all_reduce"]


@pytest.mark.parametrize("recompute, dropout", [(False, 0.0), (False, 0.1), (True, 0.0)])
def test_ulysses_activations_by_hand(recompute, dropout):
    """Under Ulysses N each rank keeps s/N tokens outside attention; inside it the whole sequence for a/N heads:
    q, k, v and the log-sum-exp as many bytes as s/N tokens of all heads, plus the fused kernel's output (s/N h e
    per layer) before the reverse all-to-all; the CPU math kernel's a s^2 probabilities for a/N heads."""
    c = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=256, max_position_embeddings=256,
                  padded_vocab_size=512, hidden_dropout=dropout, attention_dropout=dropout)
    for device in ("cpu", "cuda"):
        serial = TrainingSetup(world_size=1, micro_batch_size=2, device=device, activation_recompute=recompute)
        ulysses = replace(serial, world_size=4, sequence_parallel_size=4)
        shorter = activation_bytes(replace(c, seq_length=64), serial)
        extra = 0 if recompute else 2 * 2 * 64 * 64 * 4  # layers x b x s/N x h x fp32
        if device == "cpu" and dropout and not recompute:  # probabilities: a/N heads over 256, not a over 64
            extra = 2 * 4 * 2 * (256 * 256 / 4 - 64 * 64) * 3 * 4
        assert activation_bytes(c, ulysses) == shorter + extra, device
        assert memory_per_rank(c, ulysses)["output_buffer"] == memory_per_rank(replace(c, seq_length=64),
                                                                               serial)["output_buffer"]
