"""A step's time, predicted: compute, collectives and offload transfers, less what overlaps.

The inputs are rates measured at start-up by megatron/accounting/measure/compute_probe.py and
megatron/accounting/measure/comm_probe.py (or a
link the user describes with flags), never the run's own step time.

    total = compute + communication + offload + host - overlap
    compute = hardware FLOPs of the rank's share of the step / flops_per_s
              + the engine's passes over the rank's gradients: GRADIENT_PASSES x their bytes / device_copy_bytes_per_s
              (+ the optimizer step, optimizer_step_s + partition elements x optimizer_s_per_element, when it runs
              on the rank)
    communication = sum over kinds of messages x latency_s + bytes sent x seconds_per_byte
                    (ZeRO 1-2's gradient reduction at the cost of `reduce`, the op DeepSpeed issues for it;
                    DeepSpeed-Ulysses' all-to-alls at the all-gather's)
    offload = host optimizer step + PCIe bytes / host_copy_bytes_per_s + NVMe bytes / nvme_bytes_per_s
    host = the engine's own host work: per parameter tensor, stage-3 module hook, bucket flush and host
           synchronisation (host_work.py's counts, megatron/accounting/measure/host_probe.py's coefficients)
    overlap = ZeRO's gradient reductions hidden behind the backward, and stage 3's prefetched parameter
              gathers behind the pass they serve (CUDA with overlap_comm; 0 on gloo)

Bytes sent are the ZeRO paper's volumes (traffic.py, megatron/accounting/measure/comm_counter.py's definition); what
the wire
costs per such byte is in seconds_per_byte, whose per-backend factors COST_FACTORS gives when the link comes
from flags. Messages are counted by `messages_per_step`, which follows DeepSpeed 0.19.8's bucketing and
stage-3 prefetching for this model.
"""
from __future__ import annotations

import collections
import math
from dataclasses import dataclass, replace

from megatron.accounting.predict.flops import (hardware_flops_per_iteration, model_flops_per_iteration,
                                              output_layer_hardware_flops)
from megatron.accounting.predict.memory import runs_bf16_optimizer
from megatron.accounting.predict.parameters import parameters_on_rank
from megatron.accounting.predict.traffic import (TRAFFIC_KINDS, moe_all_to_all_per_step, offload_transfer_per_step,
                                               reduces_to_owners, ulysses_all_to_all_per_step,
                                               ulysses_all_to_alls_per_step, zero_traffic_per_step)
from megatron.accounting.predict.training_setup import AccountingError, TrainingSetup
from megatron.model.config import GPTConfig
from megatron.model.recipe import mlp_part, norm_part


@dataclass(frozen=True)
class CollectiveCost:
    """One kind of collective on one group: seconds = latency_s + seconds_per_byte * bytes sent, bytes sent
    as megatron/accounting/measure/comm_counter.py counts them (the ZeRO paper's volume, not what the wire carries)."""
    latency_s: float
    seconds_per_byte: float

    def seconds(self, bytes_sent: float, messages: int) -> float:
        return messages * self.latency_s + bytes_sent * self.seconds_per_byte


@dataclass(frozen=True)
class LinkCosts:
    """What each kind of collective (accounting.TRAFFIC_KINDS) costs on the data-parallel group, and, where
    known, what a `reduce` costs: ZeRO 1-2's gradient reduction (`gradient_reduction_op`), which the counter
    books as reduce-scatter traffic but gloo runs slower per byte at training sizes."""
    costs: dict[str, CollectiveCost]
    source: str  # "probe" (measured at start-up) or "flags" (the user's bandwidth and latency)
    seconds: float | None = None  # how long the start-up probe took; None: not probed

    def gradient_reduction(self, op: str) -> CollectiveCost:
        """The cost of `op` ("reduce" or "reduce_scatter"); a link without a reduce cost prices it as a
        reduce-scatter."""
        return self.costs.get(op, self.costs["reduce_scatter"])


@dataclass(frozen=True)
class ComputeRates:
    """The rank's own speeds, measured at start-up with the run's shapes, dtype and optimizer."""
    flops_per_s: float  # hardware FLOPs per second of a transformer layer's forward and backward
    optimizer_s_per_element: float  # the optimizer's step per parameter element where it runs
    host_copy_bytes_per_s: float  # accelerator <-> host copies (offload)
    nvme_bytes_per_s: float | None = None  # reads and writes of the swap folder (ZeRO-Infinity); None: no NVMe
    # the model's ends (embeddings, final LayerNorm, the output layer's logits and loss), forward and backward, per
    # output-layer FLOP: one large matmul, faster per FLOP than a small model's layers; None: at flops_per_s
    output_flops_per_s: float | None = None
    # copies within the accelerator's memory: the engine's passes over the gradients (GRADIENT_PASSES); on a CPU
    # rank the host copies' rate; None: those passes left out
    device_copy_bytes_per_s: float | None = None
    # the optimizer step's fixed seconds (kernel launches, synchronisation, Python), paid once a step whatever its
    # elements: the probe fits fixed + per element through two sizes, so neither holds the other's part
    optimizer_step_s: float = 0.0


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step, by part; `host` the engine's host work (host_work.py), `overlap` the
    communication hidden behind compute, `bubble` the pipeline's idle time (predicted only when asked: the runs'
    time line leaves it out)."""
    compute: float
    communication: float
    offload: float
    overlap: float = 0.0
    bubble: float = 0.0
    host: float = 0.0

    @property
    def total(self) -> float:
        return self.compute + self.communication + self.offload + self.host - self.overlap + self.bubble


# Wire seconds per paper byte, relative to bytes / bandwidth, per backend and kind. gloo: measured on two hosts
# at 200 Mbit/s (issue 32): its reduce-scatter costs about what an all-reduce of the same input costs, and its
# all-gather and broadcast are not the bandwidth-optimal rings either; a reduce to one rank of each partition
# in turn, ZeRO 1-2's gradient reduction, moved 8.2-8.4 MB/s counted at 13.7-27.4 MiB buffers (3.0; 12.4 MB/s,
# 2.0, at 4 MiB; bench/results/step_time_cpu.md). nccl: the textbook ring, which sends exactly the paper volume
# (1.0), until a GPU measures it. p2p: a send is its bytes on both.
COST_FACTORS: dict[str, dict[str, float]] = {
    "gloo": {"all_reduce": 1.07, "reduce_scatter": 2.19, "all_gather": 1.62, "broadcast": 2.10, "p2p": 1.0,
             "reduce": 3.0},
    "nccl": {**dict.fromkeys(TRAFFIC_KINDS, 1.0), "reduce": 1.0},
}


# Passes over the rank's gradients, in copies of all of them, that DeepSpeed 0.19.8's engine makes in a step
# besides the optimizer's own, counted in its code for fp32 (bench/results/step_time_cpu.md): flattening into
# the reduction bucket and copying back, averaging over the data-parallel ranks, the norm (in float64 on the CPU
# accelerator) and clipping; stage 3 also copies the reduced partitions into its flat gradient buffer. On 2 CPU
# ranks of the tiny preset they are 8-10 ms of a 350-450 ms step.
GRADIENT_PASSES: dict[int, float] = {0: 4.5, 1: 5.25, 2: 5.25, 3: 6.25}


def gradient_pass_seconds(config: GPTConfig, setup: TrainingSetup, stage: int, rates: ComputeRates) -> float:
    """Seconds of the engine's GRADIENT_PASSES over the gradients of this rank's parameters (pipeline `stage`'s,
    its TP slices) at rates.device_copy_bytes_per_s; 0 when that rate is not known."""
    if rates.device_copy_bytes_per_s is None:
        return 0.0
    gradient_bytes = parameters_on_rank(config, setup.tensor_parallel_size, setup.pipeline_parallel_size,
                                        stage) * setup.element_bytes
    return GRADIENT_PASSES[setup.zero_stage] * gradient_bytes / rates.device_copy_bytes_per_s


def gradient_reduction_op(setup: TrainingSetup, zero: dict) -> str:
    """The torch.distributed op the data-parallel gradient reduction is issued as: "reduce" at ZeRO 1-2 with
    DeepSpeed's reduce_scatter on (its default, and megatron/deepspeed_config.py's), whose average_tensor
    reduces each bucket's slice to the partition's owner with dist.reduce; "reduce_scatter" otherwise (ZeRO-3's
    reduce_scatter_tensor; stage 0 and the bf16 optimizer all-reduce and send no such traffic). `zero`: the
    DeepSpeed config's zero_optimization section."""
    stage12 = setup.zero_stage in (1, 2) and not runs_bf16_optimizer(setup)
    return "reduce" if stage12 and reduces_to_owners(zero) else "reduce_scatter"


def link_costs_from_flags(backend: str, bandwidth_gbps: float, latency_us: float) -> LinkCosts:
    """The link a user describes: `bandwidth_gbps` gigabits per second (as links are quoted: 200 Mbit/s is 0.2)
    and `latency_us` microseconds per message; each kind's seconds per byte is its COST_FACTORS entry over
    the bandwidth in bytes per second."""
    if backend not in COST_FACTORS:
        raise AccountingError(f"no cost factors for backend {backend!r}; known: {sorted(COST_FACTORS)}")
    if not bandwidth_gbps > 0 or not latency_us >= 0:
        raise AccountingError(f"link bandwidth must be > 0 Gbit/s and latency >= 0 us, got {bandwidth_gbps} "
                              f"and {latency_us}")
    bytes_per_s = bandwidth_gbps * 1e9 / 8
    return LinkCosts({kind: CollectiveCost(latency_us / 1e6, factor / bytes_per_s)
                      for kind, factor in COST_FACTORS[backend].items()}, source="flags")


def hierarchical_link_costs(backend: str, group_size: int, group_ranks_per_node: int, gpus_per_node: int,
                            intra_node_gbps: float, inter_node_gbps: float, latency_us: float) -> LinkCosts:
    """A group of `group_size` ranks, `group_ranks_per_node` of them on each node it spans, reducing and
    gathering hierarchically: inside the node first, over the link each GPU has there (`intra_node_gbps`, per
    direction), then across the nodes over the node's own link (`inter_node_gbps`, all its NICs), which its
    `gpus_per_node` GPUs share, each of them busy with a group of its own at the same time. Per byte of the
    buffer a reduce-scatter (or all-gather) of k ranks per node over m nodes takes
        (k-1)/k / intra + (m-1)/m / k x gpus_per_node / inter   seconds
    (the inter-node step moves 1/k of the buffer per rank); an all-reduce is both, twice the bytes. Divided by
    the bytes counted as sent ((n-1)/n of the buffer, n = k m) this is each kind's seconds per byte, times its
    COST_FACTORS entry. One node (m = 1) is the plain ring at `intra_node_gbps`; one rank per node (k = 1) the
    ring over the node's link, a GPU's share of it. Each level a message crosses costs `latency_us` once.
    p2p (a pipeline's sends between neighbouring ranks) takes the slower level the group spans."""
    k, n = group_ranks_per_node, group_size
    if not 1 <= k <= gpus_per_node or n % k:
        raise AccountingError(f"a group of {n} ranks cannot have {k} of them on each node of {gpus_per_node} GPUs")
    if backend not in COST_FACTORS:
        raise AccountingError(f"no cost factors for backend {backend!r}; known: {sorted(COST_FACTORS)}")
    if not (intra_node_gbps > 0 and inter_node_gbps > 0 and latency_us >= 0):
        raise AccountingError(f"link bandwidths must be > 0 Gbit/s and latency >= 0 us, got {intra_node_gbps}, "
                              f"{inter_node_gbps} and {latency_us}")
    m = n // k
    intra, inter = intra_node_gbps * 1e9 / 8, inter_node_gbps * 1e9 / 8 / gpus_per_node  # bytes/s for one GPU
    per_buffer_byte = (k - 1) / k / intra + (m - 1) / m / k / inter
    per_sent_byte = per_buffer_byte / ((n - 1) / n) if n > 1 else 0.0
    latency = latency_us / 1e6 * ((k > 1) + (m > 1))
    p2p = 1 / inter if m > 1 else 1 / intra
    return LinkCosts({kind: CollectiveCost(latency if kind != "p2p" else latency_us / 1e6,
                                           factor * (p2p if kind == "p2p" else per_sent_byte))
                      for kind, factor in COST_FACTORS[backend].items()}, source="flags")


def pipeline_bubble(forward_backward_s: float, setup: TrainingSetup) -> float:
    """Seconds a rank idles while 1F1B's pipeline fills and drains: (p-1)/m of its forward and backward compute
    for p stages and m micro-batches per step (Narayanan et al. 2021, section 2.2.1)."""
    p, m = setup.pipeline_parallel_size, setup.gradient_accumulation_steps
    return (p - 1) / m * forward_backward_s


# --- Messages: how many collectives a rank issues per step --------------------------------------------------
# DeepSpeed 0.19.8's engine all-reduces stage 0's (and its bf16 optimizer's) gradients in chunks of this many
# elements (engine.MEMORY_OPT_ALLREDUCE_SIZE), whatever the config's bucket sizes.
_ENGINE_ALLREDUCE_ELEMENTS = 500_000_000
# DeepSpeed 0.19.8's defaults (runtime/zero/config.py) for the bucket keys a ZeRO config leaves out
_DEEPSPEED_BUCKETS = dict(reduce_bucket_size=500_000_000, stage3_prefetch_bucket_size=50_000_000,
                          stage3_param_persistence_threshold=100_000, stage3_max_live_parameters=1_000_000_000)


@dataclass(frozen=True)
class _Module:
    """A module holding parameters: its kind and its parameters' elements on one TP rank, weight first."""
    kind: str  # "words", "positions", "layernorm", "column" (QKV, MLP in), "row" (attention out, MLP out)
    sizes: tuple[int, ...]

    def group(self, index: int) -> int:
        """megatron/optimizer.py's group: 0 the matrices (weight decay), 1 biases and LayerNorm weights."""
        return 0 if index == 0 and self.kind != "layernorm" else 1


def _modules(config: GPTConfig, tp: int, pp: int, stage: int) -> list[_Module]:
    """The parameter-holding modules of pipeline `stage` in forward order (accounting.parameter_groups_on_rank's
    sizes); the last stage of a pipeline holds its own copy of the tied word embedding."""
    h, f, qkv, f_in = config.hidden_size, config.ffn_hidden_size, h_qkv(config), mlp_part(config).input_width(config)
    words = _Module("words", (config.padded_vocab_size // tp * h,))
    positions = [_Module("positions", (config.learned_positions * h,))] if config.learned_positions else []
    modules = [words, *positions] if stage == 0 else []
    norm = _Module("layernorm", tuple(norm_part(config).vectors(h)))

    def linear(kind: str, weight: int, bias: int) -> _Module:  # --disable-bias-linear: the weight alone
        return _Module(kind, (weight,) if config.disable_bias_linear else (weight, bias))
    for _ in range(config.num_layers // pp):
        modules += [norm, linear("column", h * qkv // tp, qkv // tp), linear("row", h * h // tp, h), norm,
                    linear("column", h * f_in // tp, f_in // tp), linear("row", f * h // tp, h)]
    if stage == pp - 1:
        modules.append(norm)
        if config.untie_embeddings_and_output_weights:
            modules.append(words)  # the untied output layer
        elif pp > 1:
            modules += [words, *positions]  # the tied embedding's copy, its unused position table too
    return modules


def h_qkv(config: GPTConfig) -> int:
    """The fused QKV's output features: h queries and the K/V width twice (grouped-query attention: smaller)."""
    return config.hidden_size + 2 * config.kv_channels


def _gradient_order(modules: list[_Module], stage3: bool) -> list[tuple[int, int]]:
    """(module, parameter) in the order their gradients are ready, as measured on 2 CPU ranks: the modules
    backwards (the embeddings last: positions, then the tied word embedding), LayerNorm weight before bias, a
    linear's bias before its weight, except that ZeRO-3's linear function yields a column-parallel layer's
    weight first (a row-parallel layer adds its bias outside the matmul)."""
    def within(module: _Module) -> tuple[int, ...]:
        if len(module.sizes) > 1 and (module.kind == "row" or (module.kind == "column" and not stage3)):
            return (1, 0)
        return tuple(range(len(module.sizes)))
    return [(m, i) for m in reversed(range(len(modules))) for i in within(modules[m])]


def _zero12_reduces(modules: list[_Module], order: list[tuple[int, int]], dp: int, bucket: int) -> int:
    """Reduces of one gradient reduction at ZeRO 1-2 (stage_1_and_2.py, reduce_scatter on, multi-rank bucket
    all-reduce off): each optimizer group is flattened, padded to 2 x dp elements and cut into dp partitions;
    gradients fill a bucket in `order` until the next one would overflow reduce_bucket_size (a larger one goes
    alone), and each bucket is reduced with one reduce per partition it touches."""
    owners = {}
    for group in (0, 1):
        params = [(m, i) for m, module in enumerate(modules) for i in range(len(module.sizes))
                  if module.group(i) == group]
        total = sum(modules[m].sizes[i] for m, i in params)
        part = math.ceil(total / (2 * dp)) * 2 * dp // dp or 1
        start = 0
        for m, i in params:
            end = start + modules[m].sizes[i]
            owners[m, i] = set(range(start // part, (end - 1) // part + 1))  # the ranks it is reduced to
            start = end
    reduces, filled, ranks = 0, 0, set()
    for m, i in order:
        if filled + modules[m].sizes[i] > bucket:
            reduces, filled, ranks = reduces + len(ranks), 0, set()
        filled += modules[m].sizes[i]
        ranks |= owners[m, i]
    return reduces + len(ranks)


def _zero12_buckets(modules: list[_Module], order: list[tuple[int, int]], bucket: int) -> int:
    """Buckets of one gradient reduction at ZeRO 1-2 when each bucket is all-reduced whole (`reduces_to_owners`
    false): gradients fill a bucket in `order` until the next one would overflow reduce_bucket_size."""
    calls, filled = 0, 0
    for m, i in order:
        if filled and filled + modules[m].sizes[i] > bucket:
            calls, filled = calls + 1, 0
        filled += modules[m].sizes[i]
    return calls + (filled > 0)


def _stage3_reduce_scatters(modules: list[_Module], bucket: int) -> int:
    """Reduce-scatters of one backward at ZeRO-3: one per bucket of gradients, a bucket closed when the next
    gradient would overflow reduce_bucket_size."""
    calls, filled = 0, 0
    for m, i in _gradient_order(modules, stage3=True):
        if filled and filled + modules[m].sizes[i] > bucket:
            calls, filled = calls + 1, 0
        filled += modules[m].sizes[i]
    return calls + (filled > 0)


def _stage3_trace(modules: list[_Module]) -> tuple[list[tuple[tuple, bool]], int]:
    """The modules ZeRO-3's parameter coordinator steps through in one forward and backward, in order, each as
    (its parameters, released right after it); modules without parameters (the GPT model, layers, attention,
    MLP, dropouts: DeepSpeed hooks every module) count as steps, where the coordinator prefetches too. The GPT
    model holds the tied word embedding for the output layer (until the end of the forward, and through the
    backward); the embeddings' backward hooks never fire (their input needs no gradient). Also returns the
    forward's length. As traced on 2 CPU ranks (tests/test_step_time_calibration.py)."""
    params = [tuple((m, i) for i in range(len(module.sizes))) for m, module in enumerate(modules)]
    kinds = [module.kind for module in modules]
    empty = ((), False)
    first = "words" in kinds[:1]
    layers = [params[m:m + 6] for m in range(2 if first else 0, len(modules) - 6 + 1, 6)
              if kinds[m:m + 6] == ["layernorm", "column", "row"] * 2]
    final = [(params[-1], True)] if kinds[-1:] == ["layernorm"] else []
    forward = [(params[0], False), (params[0], True), (params[1], True), empty] if first else []
    for ln1, qkv, dense, ln2, mlp_in, mlp_out in layers:
        forward += [empty, (ln1, True), empty, (qkv, True), (dense, True), empty, (ln2, True), empty,
                    (mlp_in, True), (mlp_out, True), empty]
    forward += final
    backward = ([(params[0], False)] if first else []) + final
    for ln1, qkv, dense, ln2, mlp_in, mlp_out in reversed(layers):
        backward += [empty, empty, empty, (mlp_out, True), (mlp_in, True), (ln2, True), empty, empty,
                     (dense, True), (qkv, True), (ln1, True)]
    backward += [empty, (params[1], False), (params[0], False)] if first else []
    return forward + backward, len(forward)


def _stage3_gathers(modules: list[_Module], buckets: dict) -> int:
    """All-gathers of one forward and backward at ZeRO-3, replaying DeepSpeed 0.19.8's
    PartitionedParameterCoordinator once its trace is recorded: at each module it gathers the module's missing
    parameters in one call, then prefetches (one call) the next parameters of the trace not yet available until
    stage3_prefetch_bucket_size elements or the live budget (stage3_max_live_parameters less what is gathered)
    is reached; parameters under stage3_param_persistence_threshold stay whole. A module releases its
    parameters after it ran unless the prefetcher has looked past a later use of them (stage3_max_reuse_distance
    is 0). Small models whose parameters fit the live budget are gathered once per forward and backward, large
    ones once per module and pass."""
    trace, forward_length = _stage3_trace(modules)
    numel = {(m, i): modules[m].sizes[i] for m in range(len(modules)) for i in range(len(modules[m].sizes))}
    whole = {p for p, n in numel.items() if n <= buckets["stage3_param_persistence_threshold"]}
    available, holders, live, calls = set(whole), collections.defaultdict(set), 0, 0
    queue = collections.deque((p, step) for step, (params, _) in enumerate(trace) for p in sorted(params))
    fetched_for = collections.defaultdict(lambda: -1)

    def gather(params) -> None:
        nonlocal live, calls
        calls += bool(params)
        available.update(params)
        live += sum(numel[p] for p in params)

    def release(step: int, now: int) -> None:
        nonlocal live
        for p in trace[step][0]:
            holders[p].discard(step)
            if p in available and p not in whole and not holders[p] and fetched_for[p] <= now:
                available.discard(p)
                live -= numel[p]

    for step, (params, released) in enumerate(trace):
        gather([p for p in params if p not in available])
        own_entries = [p for p in params if fetched_for[p] < step]  # those the prefetcher has not taken yet
        for p in params:
            holders[p].add(step)
        for _ in own_entries:
            p, used_at = queue.popleft()
            fetched_for[p] = used_at
        budget = min(buckets["stage3_max_live_parameters"] - live, buckets["stage3_prefetch_bucket_size"])
        prefetch, prefetched = set(), 0
        while queue and prefetched < budget:
            p, used_at = queue.popleft()
            fetched_for[p] = max(fetched_for[p], used_at)
            if p not in available and p not in prefetch:
                prefetch.add(p)
                prefetched += numel[p]
        gather(prefetch)
        if released:
            release(step, step + 1)
        if step == forward_length - 1 and trace[0][0]:
            release(0, step + 1)  # the GPT model's own forward ends: the word embedding it held
    return calls


def _engine_allreduces(modules: list[_Module]) -> int:
    """All-reduces of DeepSpeed's engine over the gradients: chunks closed once past its fixed element count."""
    calls, filled = 0, 0
    for module in modules:
        for n in module.sizes:
            filled += n
            if filled > _ENGINE_ALLREDUCE_ELEMENTS:
                calls, filled = calls + 1, 0
    return calls + (filled > 0)


def _tensor_parallel_messages(config: GPTConfig, setup: TrainingSetup, stage: int) -> dict[str, int]:
    """Collectives over the TP group per micro-batch (megatron/core/tensor_parallel): per layer the four
    activation all-reduces (reduce-scatters and all-gathers under sequence parallelism, where the LayerNorm
    weights' and row-parallel biases' gradients are all-reduced too, six per layer); the word embedding's
    all-reduce on the first stage; the output layer's input (its gradient) and the vocab-parallel loss's three
    all-reduces (max, sum of exponentials, target logit) on the last."""
    first, last = stage == 0, stage == setup.pipeline_parallel_size - 1
    layers = config.num_layers // setup.pipeline_parallel_size
    if not setup.sequence_parallel:
        return dict(all_reduce=4 * layers + first + last + 3 * last)
    return dict(all_gather=4 * layers + first + last, reduce_scatter=4 * layers + last,
                all_reduce=first + 3 * last + 6 * layers + 2 * last)


def _bucket_sizes(buckets: dict | None) -> dict[str, int]:
    """The run's bucket sizes, DeepSpeed's defaults for the keys `buckets` leaves out."""
    if buckets is None:
        raise AccountingError("messages_per_step needs the run's DeepSpeed bucket sizes "
                              "(megatron/deepspeed_config.py's bucket_sizes)")
    return {key: int(buckets.get(key, default)) for key, default in _DEEPSPEED_BUCKETS.items()}


def messages_per_step(config: GPTConfig, setup: TrainingSetup, stage: int = 0, buckets: dict | None = None
                      ) -> dict[str, int]:
    """Collectives one rank of pipeline `stage` issues per optimizer step on groups of two or more ranks, per
    kind (TRAFFIC_KINDS; a reduce counts as a reduce-scatter, as in megatron/accounting/measure/comm_counter.py): the
    latency term.
    `buckets`: the run's bucket sizes, megatron/deepspeed_config.py's bucket_sizes(...) or the DeepSpeed
    config's zero_optimization section (keys it leaves out take DeepSpeed's defaults).

    Data parallelism, per step (g micro-batches): stage 0 and DeepSpeed's bf16 optimizer all-reduce the
    gradients after the last backward (chunks of 5e8 elements), the bf16 optimizer then all-gathers each
    optimizer group's parameters; stages 1-2 reduce bucket by bucket (`_zero12_reduces`; stage 2 at every
    micro-batch, stage 1 at the last, in the optimizer's order on CPU and the gradients' order with CUDA's
    overlap_comm), all-gather each group's updated partition and all-reduce each group's gradient norm, plus an
    overflow flag in bf16 and fp16; stage 3 gathers parameters (`_stage3_gathers`) and reduce-scatters gradient
    buckets at every micro-batch, all-reduces each group's norm and gathers each persistent parameter after the step.
    Model parallelism (TP x PP > 1) adds the optimizer's norm all-reduces over the model-parallel group (ours
    at stage 0: megatron/optimizer.py's in fp32, megatron/stage0_optimizer.py's in bf16/fp16), TP the
    per-micro-batch collectives of `_tensor_parallel_messages`, PP a send per micro-batch and boundary, the
    tied embedding's all-reduce on the first and last stage, the loss broadcast to every stage and, with data
    parallelism, its all-reduce on the last. Measured against megatron/accounting/measure/comm_counter.py's calls on 2
    CPU ranks
    for stages 0-3 in fp32 and bf16 (tests/test_step_time_calibration.py); fp16, offload and CUDA's
    overlap_comm follow DeepSpeed's code unmeasured."""
    to_owners, buckets = reduces_to_owners(buckets), _bucket_sizes(buckets)
    tp, pp, dp, g = (setup.tensor_parallel_size, setup.pipeline_parallel_size, setup.zero_partitions,
                     setup.gradient_accumulation_steps)
    zero, mixed = setup.zero_stage, setup.precision != "fp32"
    modules = _modules(config, tp, pp, stage)
    messages = collections.Counter()
    if dp > 1:
        if zero == 0 or runs_bf16_optimizer(setup):
            messages["all_reduce"] += _engine_allreduces(modules)
            messages["all_gather"] += 2 * (zero == 1)
        elif zero in (1, 2):
            overlap = setup.device == "cuda"  # the generated config's overlap_comm: the gradients' own order
            order = _gradient_order(modules, stage3=False) if zero == 2 or overlap else [
                (m, i) for group in (0, 1) for m, module in enumerate(modules)
                for i in range(len(module.sizes)) if module.group(i) == group]
            reductions, bucket = (g if zero == 2 else 1), buckets["reduce_bucket_size"]
            if to_owners:
                messages["reduce_scatter"] += reductions * _zero12_reduces(modules, order, dp, bucket)
            else:
                messages["all_reduce"] += reductions * _zero12_buckets(modules, order, bucket)
            messages["all_gather"] += 2
            messages["all_reduce"] += 2 + mixed
        else:
            messages["all_gather"] += g * _stage3_gathers(modules, buckets)
            messages["all_gather"] += sum(n <= buckets["stage3_param_persistence_threshold"]
                                          for module in modules for n in module.sizes)
            messages["reduce_scatter"] += g * _stage3_reduce_scatters(modules, buckets["reduce_bucket_size"])
            # the gradient norm, one all-reduce per optimizer group (decay and no decay)
            messages["all_reduce"] += 2 + (setup.precision == "fp16")
    if tp * pp > 1:
        if zero == 0:
            messages["all_reduce"] += 1
        elif runs_bf16_optimizer(setup):
            messages["all_reduce"] += 1
        elif zero == 3:
            messages["all_reduce"] += 2 + (setup.precision == "fp16")
        else:
            messages["all_reduce"] += 2 + mixed
    if tp > 1:
        for kind, count in _tensor_parallel_messages(config, setup, stage).items():
            messages[kind] += g * count
    if pp > 1:
        messages["p2p"] += g * ((stage > 0) + (stage < pp - 1))
        messages["all_reduce"] += (stage in (0, pp - 1)) + (stage == pp - 1 and dp > 1)
        messages["broadcast"] += 1
    return {kind: messages[kind] for kind in TRAFFIC_KINDS}


# --- The step's time --------------------------------------------------------------------------------------------
def stage3_gather_seconds(config: GPTConfig, setup: TrainingSetup, stage: int, link: LinkCosts, buckets: dict
                          ) -> float:
    """Seconds of ZeRO-3's parameter all-gathers in the forwards and backwards of a step on the data-parallel
    group (zero_traffic_per_step's 2 g P of all-gathers, `_stage3_gathers` calls per micro-batch; the persistent
    parameters' gathers after the step are left out); 0 below stage 3. With overlap_comm DeepSpeed 0.19.8 issues
    them on a side stream (partitioned_param_coordinator.py), the prefetched ones ahead of their module."""
    if setup.zero_stage != 3 or setup.zero_partitions == 1:
        return 0.0
    data_parallel = replace(setup, sequence_parallel=False)  # TP's all-gathers become all-reduces
    gathered = zero_traffic_per_step(config, data_parallel, stage)["all_gather"]
    modules = _modules(config, setup.tensor_parallel_size, setup.pipeline_parallel_size, stage)
    calls = setup.gradient_accumulation_steps * _stage3_gathers(modules, _bucket_sizes(buckets))
    return link.costs["all_gather"].seconds(gathered, calls)


def optimizer_elements(config: GPTConfig, setup: TrainingSetup, stage: int = 0) -> int:
    """Parameter elements this rank's optimizer steps: its ZeRO partition (1/(SP x DP) of its parameters, rounded
    up), or all of them at stage 0."""
    params = parameters_on_rank(config, setup.tensor_parallel_size, setup.pipeline_parallel_size, stage)
    return params if setup.zero_stage == 0 else math.ceil(params / setup.zero_partitions)


def model_parallel_alone(config: GPTConfig, setup: TrainingSetup) -> tuple[GPTConfig, TrainingSetup]:
    """The same layout without data parallelism: what its TP and PP collectives send alone. A DeepSpeed-Ulysses
    rank's TP collectives carry its s/N tokens, so its sequence ranks become a shorter sequence; MoE's all-to-alls
    are apart (moe_all_to_all_seconds)."""
    alone = replace(setup, world_size=setup.tensor_parallel_size * setup.pipeline_parallel_size,
                    sequence_parallel_size=1, expert_parallel_size=1)
    return replace(config, seq_length=config.seq_length // setup.sequence_parallel_size), alone


def ulysses_seconds(config: GPTConfig, setup: TrainingSetup, link: LinkCosts) -> float:
    """Seconds of DeepSpeed-Ulysses' all-to-alls in a step (traffic.py's bytes and calls: 4 per attention layer and
    pass), at the link's "all_to_all" cost where it has one (tools/zero_plan.py's sequence group), else at its
    all-gather's: the start-up probe times no all-to-all, and like an all-gather's each rank's (n-1)/n of the
    buffer goes to the group's other ranks; 0 without Ulysses."""
    cost = link.costs.get("all_to_all", link.costs["all_gather"])
    return cost.seconds(ulysses_all_to_all_per_step(config, setup), ulysses_all_to_alls_per_step(config, setup))


def moe_all_to_all_seconds(config: GPTConfig, setup: TrainingSetup, link: LinkCosts) -> float:
    """Seconds of the MoE layers' all-to-alls and capacity all-reduces in a step (moe_all_to_all_per_step's bytes;
    4 all-to-alls per MoE layer and micro-batch), at the link's all-to-all cost as ulysses_seconds prices it."""
    sent = moe_all_to_all_per_step(config, setup)
    if not sent["all_to_all"]:
        return 0.0
    calls = 4 * sum(n > 1 for n in config.layer_experts) * setup.gradient_accumulation_steps
    cost = link.costs.get("all_to_all", link.costs["all_gather"])
    seconds = cost.seconds(sent["all_to_all"], calls)
    if sent["all_reduce"]:
        seconds += link.costs["all_reduce"].seconds(sent["all_reduce"], calls // 4)
    return seconds


def predict_step_time(config: GPTConfig, setup: TrainingSetup, stage: int, rates: ComputeRates, link: LinkCosts,
                      buckets: dict, overlap_comm: bool, model_parallel_link: LinkCosts | None = None,
                      with_bubble: bool = False, host: float = 0.0) -> StepTime:
    """Seconds of one optimizer step of a rank of pipeline `stage` (the module docstring gives the formula).

    compute: the rank's hardware FLOPs, hardware_flops_per_iteration over the global batch (recomputed forwards
    included) / world size (under DeepSpeed-Ulysses each of the N sequence ranks computes 1/N of its sequences),
    the layers' at rates.flops_per_s and the output layer's at rates.output_flops_per_s;
    plus the engine's passes over the gradients (gradient_pass_seconds); plus the optimizer's step,
    rates.optimizer_step_s and optimizer_elements at rates.optimizer_s_per_element, unless the optimizer is
    offloaded. communication: per
    kind, link.costs[kind] of zero_traffic_per_step's bytes and messages_per_step's messages (a pipeline's bubble is not modelled), the
    data-parallel gradient reduction at link.gradient_reduction(gradient_reduction_op(setup, buckets)), and
    DeepSpeed-Ulysses' all-to-alls (ulysses_seconds, on `model_parallel_link` where given), and MoE's
    (moe_all_to_all_seconds, on the data-parallel link: the expert-parallel ranks are data-parallel ones).
    offload: with the optimizer offloaded, its step on the host over the same elements; and
    offload_transfer_per_step's PCIe bytes (with --checkpoint-in-cpu the layer inputs' copies too) at
    rates.host_copy_bytes_per_s and NVMe bytes at
    rates.nvme_bytes_per_s. overlap: with overlap_comm on CUDA, ZeRO 1-3's gradient reductions (the
    reduce-scatter kind of the data-parallel traffic) run during the backward, and stage 3's parameter gathers
    (stage3_gather_seconds, half in each pass) on the coordinator's all-gather stream while the modules before
    the ones they serve compute: the forward's gathers are hidden up to the forward's compute (its third of the
    model FLOPs), the backward's with the reductions up to the backward's (the rest), an upper bound, as each
    pass's first gather waits for its module (the word embedding's, on the first stage); gloo runs collectives on
    the host thread, in line, and DeepSpeed makes no side streams on a CPU accelerator: nothing overlaps there.

    `model_parallel_link`: where tensor and pipeline parallelism's collectives run on other links than the
    data-parallel group's (tools/zero_plan.py's projection), their traffic and messages (those of the same
    layout without data parallelism) are priced on it and only the rest on `link`; None prices all on `link`.
    `with_bubble`: add the pipeline's bubble (`pipeline_bubble` of the forward and backward compute).
    `host`: seconds of the engine's host work, host_work.host_seconds (0: no host part)."""
    global_batch = setup.micro_batch_size * setup.gradient_accumulation_steps * setup.data_parallel_size
    hardware = hardware_flops_per_iteration(config, global_batch)
    output_layer = output_layer_hardware_flops(config, global_batch * config.seq_length)
    forward_backward = ((hardware - output_layer) / rates.flops_per_s
                        + output_layer / (rates.output_flops_per_s or rates.flops_per_s)) / setup.world_size
    optimizer = rates.optimizer_step_s + optimizer_elements(config, setup, stage) * rates.optimizer_s_per_element
    traffic = zero_traffic_per_step(config, setup, stage, buckets)
    messages = messages_per_step(config, setup, stage, buckets)
    if model_parallel_link is None:
        communication = sum(link.costs[kind].seconds(traffic[kind], messages[kind]) for kind in TRAFFIC_KINDS)
    else:  # without data parallelism only the TP and PP terms are left; the rest is the data-parallel group's
        config_alone, alone = model_parallel_alone(config, setup)
        mp_traffic = zero_traffic_per_step(config_alone, alone, stage)
        mp_messages = messages_per_step(config_alone, alone, stage, buckets)
        communication = sum(model_parallel_link.costs[kind].seconds(mp_traffic[kind], mp_messages[kind])
                            + link.costs[kind].seconds(traffic[kind] - mp_traffic[kind],
                                                       messages[kind] - mp_messages[kind]) for kind in TRAFFIC_KINDS)
    # ZeRO's gradient reduction, the reduce-scatter kind less TP's (sequence parallelism's) reduce-scatters,
    # priced at the cost of the op DeepSpeed issues for it rather than the reduce-scatter's
    data_parallel = replace(setup, sequence_parallel=False)  # TP's reduce-scatters become all-reduces
    reduction = (zero_traffic_per_step(config, data_parallel, stage, buckets)["reduce_scatter"],
                 messages_per_step(config, data_parallel, stage, buckets)["reduce_scatter"])
    reduction_seconds = link.gradient_reduction(gradient_reduction_op(setup, buckets)).seconds(*reduction)
    communication += reduction_seconds - link.costs["reduce_scatter"].seconds(*reduction)
    communication += ulysses_seconds(config, setup, model_parallel_link or link)
    communication += moe_all_to_all_seconds(config, setup, link)
    transfers = offload_transfer_per_step(config, setup, stage)
    if transfers["nvme"] and rates.nvme_bytes_per_s is None:
        raise AccountingError("the run offloads to NVMe but the compute probe measured no NVMe rate "
                              "(probe_compute's offload_device_path)")
    offload = transfers["pcie"] / rates.host_copy_bytes_per_s
    offload += transfers["nvme"] / rates.nvme_bytes_per_s if transfers["nvme"] else 0.0
    offload += optimizer if setup.offload_optimizer else 0.0
    overlap = 0.0
    if overlap_comm and setup.device == "cuda" and setup.zero_stage >= 1 and not runs_bf16_optimizer(setup):
        backward = forward_backward * (1 - model_flops_per_iteration(config, global_batch) / 3 / hardware)
        gathers = stage3_gather_seconds(config, setup, stage, link, buckets) / 2  # per pass
        overlap = min(gathers, forward_backward - backward) + min(reduction_seconds + gathers, backward)
    compute = forward_backward + gradient_pass_seconds(config, setup, stage, rates)
    compute += 0.0 if setup.offload_optimizer else optimizer
    bubble = pipeline_bubble(forward_backward, setup) if with_bubble else 0.0
    return StepTime(compute=compute, communication=communication, offload=offload, overlap=overlap, bubble=bubble,
                    host=host)
