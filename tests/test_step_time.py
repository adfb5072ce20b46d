"""megatron/accounting/predict/step_time.py against hand-computed numbers: the link from flags, the messages a
step issues (DeepSpeed's buckets and stage-3 prefetching replayed on a model small enough to follow by hand),
and each part of a step's predicted time. What real 2-rank runs issue: tests/test_step_time_calibration.py."""
from dataclasses import replace

import pytest

from megatron.accounting import TrainingSetup
from megatron.accounting.predict.step_time import (
    COST_FACTORS,
    CollectiveCost,
    ComputeRates,
    LinkCosts,
    StepTime,
    gradient_pass_seconds,
    gradient_reduction_op,
    hierarchical_link_costs,
    link_costs_from_flags,
    messages_per_step,
    moe_all_to_all_seconds,
    optimizer_elements,
    pipeline_bubble,
    predict_step_time,
)
from megatron.accounting.predict.traffic import OWNER_REDUCTION, moe_all_to_all_per_step, zero_traffic_per_step
from megatron.accounting.predict.training_setup import AccountingError
from megatron.model.config import GPTConfig

# One layer, h = 16, f = 64, vocabulary 64, seq 8. Parameters in module order (weight, bias):
#   words 1024, positions 128; LayerNorm 16+16, QKV 768+48, attention out 256+16, LayerNorm 16+16,
#   MLP in 1024+64, MLP out 1024+16; final LayerNorm 16+16: 4464 in all.
# Optimizer groups, flattened, 2 data-parallel ranks (padded to a multiple of 2 x 2 elements, halved):
#   matrices 4224 -> partitions [0, 2112) [2112, 4224): words, positions, QKV on rank 0, attention out on both,
#     MLP in and out on rank 1;
#   vectors 240 -> [0, 120) [120, 240): up to the second LayerNorm's weight on rank 0, its bias on both, the rest
#     on rank 1.
CONFIG = GPTConfig(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8, max_position_embeddings=8,
                   padded_vocab_size=64)
PARAMS = 4464
# reduce buckets of 1500 elements; vectors (<= 64 elements) persist whole at stage 3
# (the generated config's reduction to each partition's owner, OWNER_REDUCTION)
BUCKETS = dict(reduce_bucket_size=1500, allgather_bucket_size=1500, stage3_prefetch_bucket_size=0,
               stage3_param_persistence_threshold=100, stage3_max_live_parameters=10**6, **OWNER_REDUCTION)
KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "p2p")


def setup(**kw) -> TrainingSetup:
    return TrainingSetup(**{"world_size": 2, "micro_batch_size": 2, "device": "cpu", **kw})


def msgs(**counts) -> dict:
    return {kind: counts.get(kind, 0) for kind in KINDS}


def test_cost_factors_are_the_measured_gloo_ones_and_nccl_textbook():
    assert COST_FACTORS["gloo"] == {"all_reduce": 1.07, "reduce_scatter": 2.19, "all_gather": 1.62,
                                    "broadcast": 2.10, "p2p": 1.0, "reduce": 3.0}
    assert COST_FACTORS["nccl"] == dict.fromkeys((*KINDS, "reduce"), 1.0)


def test_link_from_flags():
    link = link_costs_from_flags("gloo", bandwidth_gbps=0.2, latency_us=100)  # 200 Mbit/s: 25e6 bytes/s
    assert link.source == "flags" and set(link.costs) == {*KINDS, "reduce"} and link.seconds is None
    assert link.gradient_reduction("reduce").seconds_per_byte == pytest.approx(3.0 / 25e6)
    # a link without a reduce cost (a probe of a run that issues none) prices a reduce as a reduce-scatter
    without = LinkCosts({kind: link.costs[kind] for kind in KINDS}, source="probe")
    assert without.gradient_reduction("reduce") == link.costs["reduce_scatter"]
    cost = link.costs["reduce_scatter"]
    assert isinstance(cost, CollectiveCost)
    assert (cost.latency_s, cost.seconds_per_byte) == pytest.approx((1e-4, 2.19 / 25e6), rel=1e-12)
    # 3 all-reduces of 1 MB together: 3 x 100 us + 1e6 x 1.07 / 25e6 s
    assert link.costs["all_reduce"].seconds(1e6, 3) == pytest.approx(3e-4 + 0.0428)
    nccl = link_costs_from_flags("nccl", bandwidth_gbps=400, latency_us=5)  # 50e9 bytes/s
    assert nccl.costs["all_gather"].seconds(1e9, 0) == pytest.approx(0.02)
    with pytest.raises(AccountingError, match="backend 'mpi'"):
        link_costs_from_flags("mpi", 1, 1)
    with pytest.raises(AccountingError, match="bandwidth"):
        link_costs_from_flags("gloo", 0, 1)


def test_stage0_and_bf16_optimizer_all_reduce_the_gradients_in_one_chunk():
    assert messages_per_step(CONFIG, setup(zero_stage=0), 0, BUCKETS) == msgs(all_reduce=1)
    # DeepSpeed's bf16 optimizer (bf16, stage 1): the same all-reduce, then an all-gather per optimizer group
    assert messages_per_step(CONFIG, setup(zero_stage=1, precision="bf16"), 0, BUCKETS) == msgs(all_reduce=1,
                                                                                               all_gather=2)


def test_stage1_reduces_in_the_optimizers_order_once_per_step():
    # buckets of 1500 in group order: [words, positions] (rank 0: 1 reduce), [QKV, attention out] (ranks 0 and 1:
    # 2), [MLP in] (1), [MLP out, every vector] (both: 2) -> 6 reduces; an all-gather and a norm all-reduce per
    # group; g = 2 changes nothing (stage 1 reduces at the last micro-batch)
    expected = msgs(reduce_scatter=6, all_gather=2, all_reduce=2)
    assert messages_per_step(CONFIG, setup(zero_stage=1), 0, BUCKETS) == expected
    assert messages_per_step(CONFIG, setup(zero_stage=1, gradient_accumulation_steps=2), 0, BUCKETS) == expected


def test_deepspeeds_default_reduction_all_reduces_whole_buckets_at_twice_the_bytes():
    """A user's JSON that leaves use_multi_rank_bucket_allreduce at DeepSpeed's default (on), or turns
    reduce_scatter off: ZeRO 1-2 all-reduce each bucket (stage_1_and_2.py's average_tensor), 2P instead of P."""
    defaults = {key: value for key, value in BUCKETS.items() if key not in OWNER_REDUCTION}
    for zero in (defaults, dict(BUCKETS, reduce_scatter=False)):
        # buckets of 1500 in group order: [words, positions], [QKV, attention out], [MLP in], [MLP out, vectors]
        assert messages_per_step(CONFIG, setup(zero_stage=1), 0, zero) == msgs(all_reduce=4 + 2, all_gather=2)
        owners, whole = (zero_traffic_per_step(CONFIG, setup(zero_stage=2, gradient_accumulation_steps=2), 0, z)
                         for z in (BUCKETS, zero))
        assert (whole["all_reduce"], whole["reduce_scatter"]) == (2 * owners["reduce_scatter"], 0)
        assert whole["all_gather"] == owners["all_gather"] > 0
    # None: the generated config's keys, as tools/zero_plan.py and the model-state tests assume
    assert zero_traffic_per_step(CONFIG, setup(zero_stage=1), 0) == zero_traffic_per_step(CONFIG, setup(zero_stage=1),
                                                                                           0, BUCKETS)


def test_stage2_reduces_in_the_gradients_order_at_every_micro_batch():
    # gradients ready: final LayerNorm, MLP out (bias, weight), MLP in (bias | weight), LayerNorm, attention out,
    # QKV bias (| weight), LayerNorm, positions (| words): buckets of 1072 (rank 1), 1376 (both), 928 (rank 0)
    # and 1024 (rank 0) elements -> 5 reduces per micro-batch; bf16 adds the overflow flag's all-reduce
    assert messages_per_step(CONFIG, setup(zero_stage=2, gradient_accumulation_steps=2), 0, BUCKETS) == msgs(
        reduce_scatter=10, all_gather=2, all_reduce=2)
    assert messages_per_step(CONFIG, setup(zero_stage=2, precision="bf16"), 0, BUCKETS) == msgs(
        reduce_scatter=5, all_gather=2, all_reduce=3)
    # with CUDA's overlap_comm stage 1 reduces in the gradients' order too
    assert messages_per_step(CONFIG, setup(zero_stage=1, device="cuda"), 0, BUCKETS)["reduce_scatter"] == 5


def test_stage3_without_prefetch_gathers_each_module_for_forward_and_backward():
    # no prefetch: forward gathers words (for the GPT model, which holds them to the output layer), positions,
    # QKV, attention out, MLP in and out (6); the backward the same 6; the 10 vectors persist and are gathered
    # after the step. Reduce-scatter buckets in ZeRO-3's gradient order (QKV's weight before its bias):
    # 1072 | 1392 | 976 | 1024 -> 4 per micro-batch. The gradient norm: one all-reduce per optimizer group.
    assert messages_per_step(CONFIG, setup(zero_stage=3, gradient_accumulation_steps=2), 0, BUCKETS) == msgs(
        all_gather=2 * 12 + 10, reduce_scatter=2 * 4, all_reduce=2)


def test_stage3_prefetching_a_model_that_fits_gathers_twice_per_micro_batch():
    # the live budget holds the whole model: the first module gathers the word embedding, then one prefetch
    # takes every other parameter, scanning the trace into the backward, so nothing is released until the end
    fits = dict(BUCKETS, stage3_prefetch_bucket_size=10**6)
    assert messages_per_step(CONFIG, setup(zero_stage=3), 0, fits)["all_gather"] == 2 + 10


def test_tensor_parallel_messages():
    # TP = 2 (no data parallelism): per micro-batch 4 activation all-reduces per layer, the embedding's, the
    # output layer input's and the loss's 3; our optimizer's norm over the model-parallel group
    assert messages_per_step(CONFIG, setup(tensor_parallel_size=2), 0, BUCKETS) == msgs(all_reduce=4 + 1 + 1 + 3 + 1)
    # sequence parallel: all-gathers 4 + embedding's backward + output layer's input; reduce-scatters 4 + output
    # layer's backward; all-reduces: embedding, loss 3, 4 LayerNorm weights and 2 row biases per layer, final LN 2
    assert messages_per_step(CONFIG, setup(tensor_parallel_size=2, sequence_parallel=True), 0, BUCKETS) == msgs(
        all_gather=6, reduce_scatter=5, all_reduce=1 + 3 + 6 + 2 + 1)


def test_pipeline_messages():
    pp2 = setup(pipeline_parallel_size=2, gradient_accumulation_steps=2)
    # each stage sends one tensor per micro-batch (activation forward, gradient back), all-reduces the tied
    # embedding and the optimizer's norm, and receives the loss broadcast
    two_layers = GPTConfig(**{**CONFIG.to_dict(), "num_layers": 2})
    for stage in (0, 1):
        assert messages_per_step(two_layers, pp2, stage, BUCKETS) == msgs(p2p=2, all_reduce=2, broadcast=1)


def test_messages_from_a_zero_config_section_take_deepspeeds_defaults():
    # a run's zero_optimization section names only some keys; the others take DeepSpeed's defaults
    section = {"stage": 2, "reduce_bucket_size": 1500, "allgather_bucket_size": 1500, "overlap_comm": False,
               **OWNER_REDUCTION}
    assert messages_per_step(CONFIG, setup(zero_stage=2), 0, section) == msgs(reduce_scatter=5, all_gather=2,
                                                                               all_reduce=2)
    # one bucket of every gradient, touching both ranks' partitions: 2 reduces
    assert messages_per_step(CONFIG, setup(zero_stage=2), 0, {"stage": 2, **OWNER_REDUCTION})["reduce_scatter"] == 2
    # DeepSpeed's default use_multi_rank_bucket_allreduce all-reduces that bucket whole: 1 all-reduce more
    assert messages_per_step(CONFIG, setup(zero_stage=2), 0, {"stage": 2}) == msgs(all_reduce=1 + 2, all_gather=2)
    # stage 3 with DeepSpeed's defaults (persistence under 1e5 elements): all 16 parameters stay whole, none is
    # gathered for a pass, each after the step
    assert messages_per_step(CONFIG, setup(zero_stage=3), 0, {"stage": 3}) == msgs(all_gather=16, reduce_scatter=1,
                                                                                    all_reduce=2)


def test_messages_need_the_buckets():
    with pytest.raises(AccountingError, match="bucket_sizes"):
        messages_per_step(CONFIG, setup(), 0, None)


# rates: 1 GFLOP/s, 10 ns per optimizer element, 1 GB/s host copies, 0.5 GB/s NVMe
RATES = ComputeRates(flops_per_s=1e9, optimizer_s_per_element=1e-8, host_copy_bytes_per_s=1e9, nvme_bytes_per_s=5e8)
GLOO = link_costs_from_flags("gloo", bandwidth_gbps=0.2, latency_us=100)  # 25e6 bytes/s
# model FLOPs of a step of 2 ranks x 2 sequences of 8 tokens (32 tokens): per token, the layer's forward
# 2 h (4h + 2f) + 4 s h = 6144 + 512 and the logits' 2 h V = 2048, times 3 for forward and backward
FLOPS = 3 * 32 * (6656 + 2048)  # 835584, 417792 per rank
SHARE = PARAMS * 4 / 2  # fp32 bytes one of 2 ranks sends per pass over the model: 8928


def test_predicted_step_time_stage1_on_gloo():
    predicted = predict_step_time(CONFIG, setup(zero_stage=1), 0, RATES, GLOO, BUCKETS, overlap_comm=False)
    assert predicted.compute == pytest.approx(417792 / 1e9 + 2232 * 1e-8)  # the layer FLOPs, the rank's half
    # 6 reduces of the gradients (8928 bytes) at the reduce's 3.0, not the reduce-scatter's 2.19 (DeepSpeed's
    # dist.reduce per partition), 2 all-gathers of the parameters (8928), 2 norm all-reduces (0)
    assert predicted.communication == pytest.approx(6e-4 + 8928 * 3.0 / 25e6 + 2e-4 + 8928 * 1.62 / 25e6 + 2e-4)
    assert predicted.offload == 0 and predicted.overlap == 0
    assert predicted.total == pytest.approx(predicted.compute + predicted.communication)
    assert optimizer_elements(CONFIG, setup(zero_stage=1)) == 2232
    assert optimizer_elements(CONFIG, setup(zero_stage=0)) == PARAMS


def test_gradient_reduction_is_priced_as_the_op_deepspeed_issues():
    # ZeRO 1-2 reduce each partition to its owner (dist.reduce); ZeRO-3 reduce-scatters; a user's config with
    # reduce_scatter off all-reduces (its traffic is the all-reduce kind; no reduce is issued); the bf16
    # optimizer sends no reduce-scatter traffic at all
    assert [gradient_reduction_op(setup(zero_stage=z), BUCKETS) for z in (0, 1, 2, 3)] == [
        "reduce_scatter", "reduce", "reduce", "reduce_scatter"]
    assert gradient_reduction_op(setup(zero_stage=1), {"reduce_scatter": False}) == "reduce_scatter"
    assert gradient_reduction_op(setup(zero_stage=1, precision="bf16"), BUCKETS) == "reduce_scatter"
    # a link whose reduce costs 1 ms + 1 us per byte and reduce-scatter 1 s + 1 s per byte: stage 2's
    # 2 micro-batches x 5 reduces of 8928 bytes each pass (10 reduces, 17856 bytes) all at the reduce's cost
    zero = CollectiveCost(0.0, 0.0)
    link = LinkCosts({**dict.fromkeys(KINDS, zero), "reduce_scatter": CollectiveCost(1.0, 1.0),
                      "reduce": CollectiveCost(1e-3, 1e-6)}, source="probe")
    stage2 = setup(zero_stage=2, gradient_accumulation_steps=2)
    assert predict_step_time(CONFIG, stage2, 0, RATES, link, BUCKETS, overlap_comm=False).communication == (
        pytest.approx(10e-3 + 17856e-6))
    # stage 3's 4 reduce-scatters of the gradients (8928 bytes) at the reduce-scatter's cost
    stage3 = predict_step_time(CONFIG, setup(zero_stage=3), 0, RATES, link, BUCKETS, overlap_comm=False)
    assert stage3.communication == pytest.approx(4 + 8928)
    # a probed link without a reduce cost prices stage 1's 6 reduces as reduce-scatters, as before
    plain = LinkCosts({kind: link.costs[kind] for kind in KINDS}, source="probe")
    stage1 = predict_step_time(CONFIG, setup(zero_stage=1), 0, RATES, plain, BUCKETS, overlap_comm=False)
    assert stage1.communication == pytest.approx(6 + 8928)


def test_the_optimizer_steps_fixed_cost_is_paid_once_a_step():
    # 1 ms a step (launches, synchronisation) on top of 10 ns per element: in compute, or in offload where the
    # optimizer runs on the host, once whatever the partition's size
    fixed = replace(RATES, optimizer_step_s=1e-3)
    for offloaded in (False, True):
        run = setup(zero_stage=2, offload_optimizer=offloaded)
        plain = predict_step_time(CONFIG, run, 0, RATES, GLOO, BUCKETS, overlap_comm=False)
        priced = predict_step_time(CONFIG, run, 0, fixed, GLOO, BUCKETS, overlap_comm=False)
        assert priced.total - plain.total == pytest.approx(1e-3)
        assert (priced.offload - plain.offload if offloaded else priced.compute - plain.compute) == pytest.approx(1e-3)


def test_engine_gradient_passes_are_priced_at_the_device_copy_rate():
    # 0.5 GB/s copies within the accelerator: the engine's 4.5 (stage 0), 5.25 (1-2) and 6.25 (3) copies of the
    # rank's 4464 fp32 gradients (17856 bytes) on top of the layers' FLOPs and the optimizer's step, whatever the
    # partition; bf16 gradients are half the bytes; a rate not known leaves them out (RATES)
    copies = replace(RATES, device_copy_bytes_per_s=5e8)
    for stage, passes in ((0, 4.5), (1, 5.25), (2, 5.25), (3, 6.25)):
        without = predict_step_time(CONFIG, setup(zero_stage=stage), 0, RATES, GLOO, BUCKETS, overlap_comm=False)
        priced = predict_step_time(CONFIG, setup(zero_stage=stage), 0, copies, GLOO, BUCKETS, overlap_comm=False)
        assert priced.compute - without.compute == pytest.approx(passes * 17856 / 5e8)
        assert priced.communication == without.communication and priced.offload == without.offload
    bf16 = setup(zero_stage=1, precision="bf16")
    assert gradient_pass_seconds(CONFIG, bf16, 0, copies) == pytest.approx(5.25 * 8928 / 5e8)
    assert gradient_pass_seconds(CONFIG, bf16, 0, RATES) == 0


def test_predicted_step_time_counts_recomputation_and_stage0_optimizer():
    recompute = GPTConfig(**{**CONFIG.to_dict(), "recompute_activations": True})
    predicted = predict_step_time(recompute, setup(zero_stage=0), 0, RATES, GLOO, BUCKETS, overlap_comm=False)
    # a second forward of the layer (32 x 6656 FLOPs) on top; stage 0 steps all 4464 parameters
    assert predicted.compute == pytest.approx((FLOPS + 32 * 6656) / 2 / 1e9 + PARAMS * 1e-8)
    assert predicted.communication == pytest.approx(1e-4 + 2 * SHARE * 1.07 / 25e6)  # one all-reduce of 2 passes


def test_predicted_step_time_counts_the_tiled_recomputed_forwards():
    """--tiled-mlp-compute recomputes the MLP's forward (2 h x 2f = 4096 FLOPs a token), --tiled-logits-loss the
    logits' (2 h V = 2048), over the step's 32 tokens, half on each rank."""
    tiled = replace(CONFIG, tiled_mlp_compute=True, tiled_logits_loss=True)
    predicted = predict_step_time(tiled, setup(zero_stage=1), 0, RATES, GLOO, BUCKETS, overlap_comm=False)
    assert predicted.compute == pytest.approx((FLOPS + 32 * (4096 + 2048)) / 2 / 1e9 + 2232 * 1e-8)


def test_predicted_offload_moves_the_optimizer_to_the_host_and_counts_transfers():
    offload = setup(zero_stage=3, offload_optimizer=True, offload_params=True)
    predicted = predict_step_time(CONFIG, offload, 0, RATES, GLOO, BUCKETS, overlap_comm=False)
    assert predicted.compute == pytest.approx(417792 / 1e9)
    # PCIe: the gradient partition down and the parameter partition up (2 x 8928 bytes), and the parameter
    # partition read for the forward and the backward gathers (2 x 8928); the host optimizer's 2232 elements
    assert predicted.offload == pytest.approx(4 * 8928 / 1e9 + 2232 * 1e-8)
    nvme = setup(zero_stage=3, offload_optimizer=True, offload_params=True, offload_device="nvme")
    # NVMe: Adam states and fp32 master (12 bytes per element of the 2232-element partition) read and written,
    # the parameter partition read at 2 gathers and written once
    on_nvme = predict_step_time(CONFIG, nvme, 0, RATES, GLOO, BUCKETS, overlap_comm=False)
    assert on_nvme.offload == pytest.approx(predicted.offload + (2 * 12 * 2232 + 3 * 8928) / 5e8)
    with pytest.raises(AccountingError, match="NVMe"):
        predict_step_time(CONFIG, nvme, 0, ComputeRates(1e9, 1e-8, 1e9), GLOO, BUCKETS, overlap_comm=False)


def test_overlap_hides_gradient_reductions_behind_the_backward_on_cuda_only():
    cuda = setup(zero_stage=2, device="cuda")
    slow = link_costs_from_flags("nccl", bandwidth_gbps=8e-6, latency_us=0)  # 1000 bytes/s: reductions 8.928 s
    fast = link_costs_from_flags("nccl", bandwidth_gbps=8, latency_us=10)  # 1e9 bytes/s
    backward = 417792 / 1e9 * 2 / 3  # two thirds of the forward and backward
    assert predict_step_time(CONFIG, cuda, 0, RATES, slow, BUCKETS, overlap_comm=True).overlap == pytest.approx(
        backward)
    # 5 reduces of 8928 bytes in all, in the gradients' order
    assert predict_step_time(CONFIG, cuda, 0, RATES, fast, BUCKETS, overlap_comm=True).overlap == pytest.approx(
        5e-5 + 8928 / 1e9)
    assert predict_step_time(CONFIG, cuda, 0, RATES, fast, BUCKETS, overlap_comm=False).overlap == 0
    assert predict_step_time(CONFIG, setup(zero_stage=2), 0, RATES, fast, BUCKETS, overlap_comm=True).overlap == 0


def test_stage3_prefetched_gathers_overlap_the_passes_on_cuda_only():
    """With overlap_comm DeepSpeed gathers stage 3's parameters on a CUDA side stream, ahead of their module: the
    forward's 6 gathers (8928 bytes) hide behind the forward's compute, the backward's 6 with the 4 gradient
    reduce-scatters (8928 bytes) behind the backward's. On CPU ranks (gloo, no side streams) nothing overlaps."""
    fast = link_costs_from_flags("nccl", bandwidth_gbps=8, latency_us=10)  # 1e9 bytes/s
    slow = link_costs_from_flags("nccl", bandwidth_gbps=8e-6, latency_us=0)  # 1000 bytes/s
    gathers, reductions = 12 * 1e-5 + 2 * 8928 / 1e9, 4 * 1e-5 + 8928 / 1e9
    cuda, cpu = setup(zero_stage=3, device="cuda"), setup(zero_stage=3)
    on_cuda = predict_step_time(CONFIG, cuda, 0, RATES, fast, BUCKETS, overlap_comm=True)
    assert on_cuda.overlap == pytest.approx(gathers + reductions)
    on_cpu = predict_step_time(CONFIG, cpu, 0, RATES, fast, BUCKETS, overlap_comm=True)
    assert on_cpu.overlap == 0 and on_cpu.total == pytest.approx(on_cuda.total + gathers + reductions)
    assert predict_step_time(CONFIG, cuda, 0, RATES, fast, BUCKETS, overlap_comm=False).overlap == 0
    # a slow link: each pass hides at most its own compute, a third of the forward and backward for the forward
    assert predict_step_time(CONFIG, cuda, 0, RATES, slow, BUCKETS, overlap_comm=True).overlap == pytest.approx(
        417792 / 1e9)


def test_step_time_total():
    assert StepTime(compute=1.0, communication=0.5, offload=0.25, overlap=0.3).total == pytest.approx(1.45)
    assert isinstance(GLOO, LinkCosts)


def test_hierarchical_link_reduces_inside_the_node_then_across_nodes():
    # 16 ranks, 8 per node: NVLink 2400 Gbit/s (300e9 bytes/s per GPU), the node's 1600 Gbit/s (200e9 bytes/s,
    # 25e9 per GPU). Per byte of the buffer: 7/8 / 300e9 inside, then 1/8 of it with (2-1)/2 across at 25e9:
    # 2.9167e-12 + 2.5e-12 s; per byte counted as sent (15/16 of the buffer) 5.7778e-12 s; two levels' latency
    link = hierarchical_link_costs("nccl", 16, 8, 8, 2400, 1600, latency_us=10)
    cost = link.costs["reduce_scatter"]
    assert cost.seconds_per_byte == pytest.approx((7 / 8 / 300e9 + 1 / 2 / 8 / 25e9) * 16 / 15, rel=1e-12)
    assert cost.latency_s == pytest.approx(2e-5) and link.costs["all_reduce"] == cost
    assert link.costs["p2p"] == CollectiveCost(1e-5, pytest.approx(1 / 25e9))  # a send crosses nodes
    # one node: the ring at the intra-node bandwidth, as link_costs_from_flags gives it
    one_node = hierarchical_link_costs("nccl", 8, 8, 8, 2400, 1600, latency_us=10)
    ring = link_costs_from_flags("nccl", 2400, 10).costs
    for kind, cost in one_node.costs.items():
        assert (cost.latency_s, cost.seconds_per_byte) == pytest.approx((ring[kind].latency_s,
                                                                         ring[kind].seconds_per_byte), rel=1e-12)
    # one rank per node (a data-parallel group under TP 8): a ring over a GPU's share of the node's link
    across = hierarchical_link_costs("nccl", 4, 1, 8, 2400, 1600, latency_us=10)
    assert across.costs["all_gather"].seconds_per_byte == pytest.approx(1 / 25e9)
    with pytest.raises(AccountingError, match="cannot have 3"):
        hierarchical_link_costs("nccl", 16, 3, 8, 2400, 1600, 10)


def test_pipeline_bubble_and_model_parallel_link():
    # 4 stages, 8 micro-batches: (4-1)/8 of the forward and backward
    assert pipeline_bubble(2.0, setup(world_size=4, pipeline_parallel_size=4, gradient_accumulation_steps=8)) == 0.75
    two_layers = GPTConfig(**{**CONFIG.to_dict(), "num_layers": 2})
    pp2 = setup(pipeline_parallel_size=2, gradient_accumulation_steps=2)
    plain = predict_step_time(two_layers, pp2, 0, RATES, GLOO, BUCKETS, overlap_comm=False)
    bubbled = predict_step_time(two_layers, pp2, 0, RATES, GLOO, BUCKETS, overlap_comm=False, with_bubble=True)
    forward_backward = plain.compute - optimizer_elements(two_layers, pp2, 0) * 1e-8
    assert plain.bubble == 0 and bubbled.bubble == pytest.approx(forward_backward / 2)
    assert bubbled.total == pytest.approx(plain.total + forward_backward / 2)
    # TP 2 without data parallelism: one layer's 4 activation all-reduces, the embedding's and the output
    # layer's, of [2, 8, 16] fp32 (1024 bytes) x 2 x 1/2 each: 6144 bytes; 10 all-reduces (with the loss's 3 and
    # the norm's), all on the model-parallel link (1e9 bytes/s, 10 us), nothing on the data-parallel one
    tp2 = setup(tensor_parallel_size=2)
    nvlink = link_costs_from_flags("nccl", bandwidth_gbps=8, latency_us=10)
    split = predict_step_time(CONFIG, tp2, 0, RATES, GLOO, BUCKETS, overlap_comm=False, model_parallel_link=nvlink)
    assert split.communication == pytest.approx(10e-5 + 6144 / 1e9)
    # with data parallelism the two parts add up to the same traffic priced on one link
    tp2dp2 = setup(world_size=4, tensor_parallel_size=2, zero_stage=1)
    whole = predict_step_time(CONFIG, tp2dp2, 0, RATES, GLOO, BUCKETS, overlap_comm=False)
    same = predict_step_time(CONFIG, tp2dp2, 0, RATES, GLOO, BUCKETS, overlap_comm=False, model_parallel_link=GLOO)
    assert same.communication == pytest.approx(whole.communication)
    free = link_costs_from_flags("nccl", bandwidth_gbps=1e12, latency_us=0)
    dp_only = predict_step_time(CONFIG, tp2dp2, 0, RATES, GLOO, BUCKETS, overlap_comm=False, model_parallel_link=free)
    mp_only = predict_step_time(CONFIG, tp2dp2, 0, RATES, free, BUCKETS, overlap_comm=False, model_parallel_link=GLOO)
    assert dp_only.communication + mp_only.communication == pytest.approx(whole.communication, rel=1e-6)
    assert 0 < mp_only.communication < whole.communication


def test_ulysses_ranks_share_the_sequences_compute_and_add_their_all_to_alls():
    """SP=2 on 2 ranks: one replica of 2 sequences, each rank computes half of them (the layer FLOPs of
    test_predicted_step_time_stage1_on_gloo's 4 sequences, a quarter per rank); ZeRO-1 partitions over both ranks
    as with DP=2; and 8 all-to-alls of the [2, 4, 16] fp32 slice (512 bytes, half of it sent) at the all-gather's
    cost."""
    sp2 = setup(zero_stage=1, sequence_parallel_size=2)
    ulysses = predict_step_time(CONFIG, sp2, 0, RATES, GLOO, BUCKETS, overlap_comm=False)
    replicas = predict_step_time(CONFIG, setup(zero_stage=1), 0, RATES, GLOO, BUCKETS, overlap_comm=False)
    assert ulysses.compute == pytest.approx(417792 / 2 / 1e9 + 2232 * 1e-8)
    assert ulysses.communication == pytest.approx(replicas.communication + 8 * 1e-4 + 8 * 256 * 1.62 / 25e6)
    recomputed = predict_step_time(CONFIG, replace(sp2, activation_recompute=True), 0, RATES, GLOO, BUCKETS,
                                   overlap_comm=False)
    assert recomputed.communication == pytest.approx(replicas.communication + 12 * 1e-4 + 12 * 256 * 1.62 / 25e6)
    # priced on the model-parallel link where there is one: all of it on a free data-parallel link
    free = link_costs_from_flags("nccl", bandwidth_gbps=1e12, latency_us=0)
    on_nvlink = predict_step_time(CONFIG, sp2, 0, RATES, free, BUCKETS, overlap_comm=False, model_parallel_link=GLOO)
    assert on_nvlink.communication == pytest.approx(8 * 1e-4 + 8 * 256 * 1.62 / 25e6, rel=1e-6)


@pytest.mark.parametrize("environ, skipped", [({}, False), ({"ZERO_LAB_SKIP_PROBES": "0"}, False),
                                              ({"ZERO_LAB_SKIP_PROBES": "1"}, True)])
def test_zero_lab_skip_probes_says_whether_to_probe(environ, skipped):
    from megatron.accounting.measure.step_timing import probes_skipped
    assert probes_skipped(environ) is skipped


def test_zero_lab_skip_probes_of_another_value_is_one_line():
    from megatron.errors import ZeroLabError
    from megatron.accounting.measure.step_timing import probes_skipped
    with pytest.raises(ZeroLabError) as error:
        probes_skipped({"ZERO_LAB_SKIP_PROBES": "yes"})
    assert str(error.value) == "ZERO_LAB_SKIP_PROBES=yes: expected 0 (probe, the default) or 1 (skip the probes)"


@pytest.mark.slow
def test_a_run_without_the_probes_says_so_and_prints_no_time_lines(checkpoint_run):
    """tests/runs.py's runs set ZERO_LAB_SKIP_PROBES=1; the drivers' runs (tests/test_drivers.py) probe and
    print the prediction and the time lines."""
    from megatron.accounting.measure.step_timing import PROBES_SKIPPED_LINE
    log = checkpoint_run.stdout
    assert log.splitlines().count(PROBES_SKIPPED_LINE) == 1
    assert "step time predicted" not in log and " time at iteration " not in log
    assert " iteration        8/       8 |" in log


def test_the_moe_all_to_alls_are_priced_at_the_links_all_to_all_cost():
    """4 all-to-alls per MoE layer and micro-batch, the capacity's bytes, at the link's all_to_all cost (else its
    all-gather's); only they change when the all-to-all costs 1 s + 1 s per byte more."""
    moe = replace(CONFIG, num_layers=2, num_experts=[4], moe_expert_parallel_size=2, moe_min_capacity=0)
    ep2 = TrainingSetup(world_size=2, micro_batch_size=2, gradient_accumulation_steps=3, expert_parallel_size=2)
    # each all-to-all: 4 experts x capacity ceil(16 / 4 x 1.0) = 4 x 16 hidden x 4 bytes, half of it sent
    sent = 4 * 3 * 4 * 4 * 16 * 4 / 2
    assert moe_all_to_all_per_step(moe, ep2)["all_to_all"] == sent
    zero = CollectiveCost(0.0, 0.0)
    free = LinkCosts(dict.fromkeys(KINDS, zero), source="probe")
    priced = LinkCosts({**free.costs, "all_to_all": CollectiveCost(1.0, 1.0)}, source="probe")
    times = [predict_step_time(moe, ep2, 0, RATES, link, BUCKETS, overlap_comm=False) for link in (free, priced)]
    assert times[1].communication - times[0].communication == pytest.approx(4 * 3 + sent)
    assert moe_all_to_all_seconds(moe, ep2, priced) == pytest.approx(4 * 3 + sent)
