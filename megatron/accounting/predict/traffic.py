"""Bytes a rank sends through collectives, and moves to and from the host and NVMe, per step."""
from __future__ import annotations

import math

from megatron.accounting.predict.memory import layer_input_bytes, runs_bf16_optimizer, zero_model_state_estimate
from megatron.accounting.predict.parameters import expert_groups_on_rank, parameters_on_rank
from megatron.accounting.predict.training_setup import TrainingSetup
from megatron.model.config import GPTConfig

TRAFFIC_KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "p2p")  # as megatron/accounting/measure/comm_counter.py


def _ring_share(group_size: int) -> float:
    """What each of n ranks sends, per byte of the whole buffer, in a reduce-scatter or all-gather."""
    return (group_size - 1) / group_size


# The zero_optimization keys with which ZeRO 1-2 reduce each gradient slice to its owner only: zero-lab's tuned
# config (megatron/deepspeed_config.py) sets them; DeepSpeed's defaults (both on) all-reduce whole buckets.
OWNER_REDUCTION = {"reduce_scatter": True, "use_multi_rank_bucket_allreduce": False}


def reduces_to_owners(zero: dict | None) -> bool:
    """Whether ZeRO 1-2 reduce each gradient slice to its partition's owner (dist.reduce, the ZeRO paper's P):
    DeepSpeed 0.19.8's average_tensor does so only with reduce_scatter on and use_multi_rank_bucket_allreduce
    off, and else all-reduces every bucket (2P). `zero`: the zero_optimization section the run uses, a key it
    leaves out at DeepSpeed's default (both on); None: megatron/deepspeed_config.py's tuned keys (reduce)."""
    if zero is None:
        return True
    return zero.get("reduce_scatter", True) and not zero.get("use_multi_rank_bucket_allreduce", True)


def ulysses_all_to_alls_per_step(config: GPTConfig, setup: TrainingSetup) -> int:
    """All-to-alls one rank issues per step under DeepSpeed-Ulysses (ulysses_all_to_all_per_step's)."""
    if setup.sequence_parallel_size == 1:
        return 0
    return config.num_layers * (12 if setup.activation_recompute else 8) * setup.gradient_accumulation_steps


def ulysses_all_to_all_per_step(config: GPTConfig, setup: TrainingSetup) -> float:
    """Bytes one rank sends per step through DeepSpeed-Ulysses' all-to-alls (setup.sequence_parallel_size N,
    docs/long-sequences.md): 4 per attention layer in the forward (q, k, v to whole sequences, the output back) and
    4 in the backward (their gradients), each of the rank's [micro batch, seq / N, hidden / tp] activation, of which
    (N-1)/N leaves the rank; a recomputed forward (--checkpoint-activations) runs its 4 again. Every micro-batch."""
    n = setup.sequence_parallel_size
    activation = (setup.micro_batch_size * (config.seq_length // n) * (config.hidden_size // setup.tensor_parallel_size)
                  * setup.element_bytes)
    return ulysses_all_to_alls_per_step(config, setup) * activation * (n - 1) / n


def zero_traffic_per_step(config: GPTConfig, setup: TrainingSetup, stage: int = 0,
                          zero: dict | None = None) -> dict[str, float]:
    """Bytes one rank of pipeline `stage` sends per optimizer step, per kind of collective, with
    megatron/accounting/measure/comm_counter.py's definition of "sent" (docs/zero-tradeoff.md).

    Data parallelism over the rank's P parameters (the ZeRO paper's volumes, in the gradient dtype,
    times (n-1)/n for the n ranks holding the same parameters: the data-parallel ones times DeepSpeed-Ulysses'
    sequence ranks): stage 0 all-reduces the gradients once per step (2P); stage 1 reduces each gradient
    partition to its owner and all-gathers the updated parameters (P + P), except under DeepSpeed's bf16 optimizer (runs_bf16_optimizer), which all-reduces the whole fp32
    gradient buffer, cast to bf16 (DeepSpeed's communication dtype), then all-gathers the updated bf16
    parameters (2P + P; measured on 2 CPU ranks, tests/test_bf16_traffic.py); stage 2 keeps only its
    gradient partition, so it reduces at every micro-batch (g P + P with g micro-batches per step; in
    bf16 its reductions stay bf16, measured, though it keeps an fp32 gradient partition); stage 3
    gathers each parameter for the forward and again for the backward and reduce-scatters the
    gradients, at every micro-batch (3 g P). The gradients' reductions are in setup.reduce_element_bytes (a
    user's JSON may set communication_data_type: fp32 in bf16 doubles their bytes), the parameters' gathers in the
    parameters' dtype. Tensor parallelism adds four
    all-reduces of a [micro batch, seq, hidden] activation per layer and micro-batch, and one each for
    the embedding's output and the output layer's input (reduce-scatters and all-gathers of the same
    volume under sequence parallelism); pipeline parallelism sends one such activation
    forward and one gradient back per micro-batch, and all-reduces the tied word embedding's gradient
    between the first and last stage.

    `zero`: the DeepSpeed config's zero_optimization section; where it leaves ZeRO 1-2 all-reducing each
    bucket (`reduces_to_owners`), their gradient reductions are all-reduces of twice the volume.

    MoE: the rank's experts the same way over their expert-data-parallel ranks (DP / EP); the all-to-alls are
    moe_all_to_all_per_step's."""
    traffic = dict.fromkeys(TRAFFIC_KINDS, 0.0)
    tp, pp, g = setup.tensor_parallel_size, setup.pipeline_parallel_size, setup.gradient_accumulation_steps
    size = parameters_on_rank(config, tp, pp, stage) * setup.element_bytes
    _add_data_parallel(traffic, size, setup.zero_partitions, setup, zero)
    experts = sum(map(sum, expert_groups_on_rank(config, setup.expert_parallel_size))) * setup.element_bytes
    if experts:  # DeepSpeed reduces (and ZeRO gathers) the experts over their expert-data-parallel ranks
        _add_data_parallel(traffic, experts, setup.expert_data_parallel_size, setup, zero)
    tokens = config.seq_length // setup.sequence_parallel_size  # a sequence's tokens on the rank
    activation = setup.micro_batch_size * tokens * config.hidden_size * setup.element_bytes
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
        if stage in (0, pp - 1) and not config.untie_embeddings_and_output_weights:  # the tied embedding's sync
            traffic["all_reduce"] += 2 * _ring_share(2) * config.padded_vocab_size // tp * config.hidden_size \
                * setup.element_bytes
    return traffic


def _add_data_parallel(traffic: dict[str, float], size: float, dp: int, setup: TrainingSetup,
                       zero: dict | None) -> None:
    """zero_traffic_per_step's data-parallel volumes of `size` bytes of parameters held by dp ranks."""
    share, g = _ring_share(dp) * size, setup.gradient_accumulation_steps
    grads = share * setup.reduce_element_bytes / setup.element_bytes  # the gradients in their reduction dtype
    if setup.zero_stage == 0:
        traffic["all_reduce"] += 2 * grads
    elif runs_bf16_optimizer(setup):
        traffic["all_reduce"] += 2 * grads
        traffic["all_gather"] += share
    elif setup.zero_stage in (1, 2):
        reductions = 1 if setup.zero_stage == 1 else g
        if reduces_to_owners(zero):
            traffic["reduce_scatter"] += reductions * grads
        else:
            traffic["all_reduce"] += reductions * 2 * grads
        traffic["all_gather"] += share
    else:
        traffic["reduce_scatter"] += g * grads
        traffic["all_gather"] += 2 * g * share


def moe_capacity(config: GPTConfig, experts: int, tokens: int) -> int:
    """Token slots per expert of one MoE layer's training forward over `tokens` tokens, as DeepSpeed's gates
    (top1gating, top2gating, topkgating) size their dispatch buffers: max(--moe-min-capacity, ceil(tokens /
    experts x --moe-train-capacity-factor x --topk)). Without token dropping the capacity is the most loaded
    expert's count (the maximum over the expert-parallel group), known only once routed: predicted here as a
    balanced gate's, ceil(tokens x topk / experts), its least."""
    if not config.moe_token_dropping:
        return math.ceil(tokens * config.topk / experts)
    return max(config.moe_min_capacity,
               math.ceil(tokens / experts * (config.moe_train_capacity_factor * config.topk)))


def moe_all_to_all_per_step(config: GPTConfig, setup: TrainingSetup,
                            capacities: list[float] | None = None) -> dict[str, float]:
    """Bytes one rank sends per step through the MoE layers (docs/moe-reference.md), by kind: at EP > 1 each MoE layer's
    forward dispatches its [experts, capacity, hidden] buffer to the experts' ranks and combines their outputs
    back (two all-to-alls, (EP-1)/EP of the buffer leaving the rank), and the backward sends their gradients the
    same way (two more), every micro-batch; without token dropping each forward first all-reduces the
    capacity (one int64, MAX) over the expert-parallel group. `capacities`: each MoE layer's capacity summed
    over the step's micro-batches, as measured (a run without token dropping); by default moe_capacity's."""
    ep, g = setup.expert_parallel_size, setup.gradient_accumulation_steps
    moe = [n for n in config.layer_experts if n > 1]
    sent = {"all_to_all": 0.0, "all_reduce": 0.0}
    if ep == 1 or not moe:
        return sent
    tokens = setup.micro_batch_size * config.seq_length
    if capacities is None:
        capacities = [g * moe_capacity(config, n, tokens) for n in moe]
    for experts, capacity in zip(moe, capacities):
        sent["all_to_all"] += 4 * experts * capacity * config.hidden_size * setup.element_bytes * _ring_share(ep)
    if not config.moe_token_dropping:
        sent["all_reduce"] += len(moe) * g * 2 * _ring_share(ep) * 8
    return sent


def offload_transfer_per_step(config: GPTConfig, setup: TrainingSetup, stage: int = 0) -> dict[str, float]:
    """Bytes one rank of pipeline `stage` moves per step between accelerator and host ("pcie") and
    between host and NVMe ("nvme") when ZeRO offloads: with the optimizer offloaded, each gradient
    reduction (once per step at stage 1, every micro-batch at 2 and 3) lands in host memory and the
    updated parameter partition comes back; with the parameters offloaded, every gather (forward and
    backward of each micro-batch) reads the partition from the host; with --checkpoint-in-cpu each layer's
    input goes out in every micro-batch's forward and comes back for its recompute. On NVMe the optimizer states are
    read and written once per step and parameter partitions read at every gather and written once."""
    partition = math.ceil(parameters_on_rank(config, setup.tensor_parallel_size, setup.pipeline_parallel_size,
                                             stage) / setup.zero_partitions)
    e, g = setup.element_bytes, setup.gradient_accumulation_steps
    reductions = 1 if setup.zero_stage <= 1 else g
    pcie = nvme = 0.0
    if setup.offload_optimizer:
        pcie += (reductions + 1) * partition * e
    if setup.offload_params:
        pcie += 2 * g * partition * e
    if setup.activation_offload:  # --checkpoint-in-cpu: each layer's input out in the forward, back for its recompute
        pcie += 2 * g * config.num_layers // setup.pipeline_parallel_size * layer_input_bytes(config, setup)
    if setup.offload_device == "nvme":
        states = zero_model_state_estimate(partition * setup.zero_partitions, setup.zero_stage,
                                           setup.zero_partitions, setup.precision)
        nvme += 2 * states["optim"] if setup.offload_optimizer else 0
        nvme += (2 * g + 1) * partition * e if setup.offload_params else 0
    return dict(pcie=pcie, nvme=nvme)
