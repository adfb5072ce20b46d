"""What each kind of collective costs on a group, measured at start-up: latency and seconds per byte sent.

`probe_link` times all-reduce, reduce-scatter, all-gather, broadcast and, where the run issues it, reduce (ZeRO
1-2's gradient reduction: one reduce per partition of a bucket, to its owner) at two buffer sizes and fits
seconds = latency + seconds_per_byte x bytes sent, bytes sent as megatron/accounting/measure/comm_counter.py counts them (the
ZeRO paper's volume), so the fitted seconds_per_byte already holds what the backend's wire costs per such
byte (gloo's reduce-scatter sends about what its all-reduce sends; docs/zero-tradeoff-reference.md). The step-time
model (megatron/accounting/predict/step_time.py) multiplies it by the bytes and messages a step sends.

The bandwidth point is a buffer near the step's largest message (`probe_buffers`): gloo's cost per byte is not
the same at every size (a reduce moved 12.4 MB/s counted at 4 MiB and 8.2 MB/s at 13.7 MiB over 200 Mbit/s,
bench/results/step_time_cpu.md), and a point whose time is far above the latency's keeps the slope steady.

The probe's collectives are issued outside comm_counter's counting(), so they are not counted as training
traffic.
"""
from __future__ import annotations

import math
import time
import warnings

import torch
import torch.distributed as dist

from megatron.accounting.measure import comm_counter
from megatron.accounting.predict.parameters import parameters_on_rank
from megatron.accounting.predict.step_time import CollectiveCost, LinkCosts, gradient_reduction_op
from megatron.accounting.predict.traffic import TRAFFIC_KINDS, zero_traffic_per_step

# float32 elements of the latency point (64 KiB) and of the bandwidth point: LARGE (4 MiB) unless the step's
# messages are larger, at most LARGEST (32 MiB: tens of ms a call on loopback, about 1.3 s over 200 Mbit/s)
SMALL, LARGE, LARGEST = 16 * 1024, 1024 * 1024, 8 * 1024 * 1024
REPEATS = 9  # timed repetitions per kind and size at most, after one warm-up
MIN_REPEATS = 3  # ... and at least, where the warm-up says REPEATS would take longer than POINT_BUDGET_S
POINT_BUDGET_S = 0.25
# the torch.distributed function each kind is timed with, as megatron/accounting/measure/comm_counter.py names it
PROBED = {"all_reduce": "all_reduce", "reduce_scatter": "reduce_scatter_tensor",
          "all_gather": "all_gather_into_tensor", "broadcast": "broadcast", "reduce": "reduce"}
# DeepSpeed 0.19.8's reduce_bucket_size when the ZeRO section leaves it out
_DEFAULT_BUCKET = 500_000_000


def probe_buffers(config, setup, stage: int, zero: dict) -> dict[str, int]:
    """float32 elements of the bandwidth point for each kind the step sends bytes with (the gradient
    reduction's kind as `gradient_reduction_op` names it): the step's largest message, which is the larger of
    reduce_bucket_size and the rank's largest parameter (DeepSpeed sends a parameter larger than the bucket
    alone; a GPT's word embedding is that one, and most of the bytes), at most the rank's parameters (a bucket
    larger than the model holds the model), between LARGE and LARGEST. Kinds the step does not send are
    probed at LARGE; "reduce" only where the run issues it."""
    tp = setup.tensor_parallel_size
    largest = max(config.padded_vocab_size, config.ffn_hidden_size) * config.hidden_size // tp
    params = parameters_on_rank(config, tp, setup.pipeline_parallel_size, stage)
    message = min(params, max(int(zero.get("reduce_bucket_size", _DEFAULT_BUCKET)), largest))
    elements = min(LARGEST, max(LARGE, message))
    traffic = zero_traffic_per_step(config, setup, stage, zero)
    gradient = gradient_reduction_op(setup, zero)
    buffers = {kind: elements if traffic[kind] > 0 else LARGE for kind in PROBED if kind != "reduce"}
    if gradient == "reduce":
        buffers["reduce"] = elements if traffic["reduce_scatter"] > 0 else LARGE
        buffers["reduce_scatter"] = LARGE  # issued as reduces: nothing sends a reduce_scatter_tensor
    return buffers


def fit(small: tuple[float, float], large: tuple[float, float]) -> CollectiveCost:
    """The line through two (bytes sent, seconds) points, kept physical when noise tilts it: a slope that is
    not positive becomes the large point's seconds per byte, a negative intercept zero latency."""
    (b1, t1), (b2, t2) = small, large
    slope = (t2 - t1) / (b2 - b1)
    if not slope > 0:
        return CollectiveCost(latency_s=0.0, seconds_per_byte=t2 / b2)
    return CollectiveCost(latency_s=max(0.0, t1 - slope * b1), seconds_per_byte=slope)


def _collective(kind: str, elements: int, group, device: torch.device):
    """A call of `kind` on a fresh float32 buffer of `elements`, the bytes comm_counter says it sends and the
    messages it issues. "reduce" is ZeRO 1-2's reduction of one bucket: one reduce of each rank's 1/n of the
    buffer to that rank, in rank order."""
    size = dist.get_world_size(group)
    buffer = torch.ones(elements, device=device)
    part = torch.empty(elements // size, device=device)
    parts = buffer.view(size, -1)
    ranks = [dist.get_global_rank(group, r) if group is not None else r for r in range(size)]
    calls = {"all_reduce": lambda: dist.all_reduce(buffer, group=group),
             "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, buffer, group=group),
             "all_gather": lambda: dist.all_gather_into_tensor(buffer, part, group=group),
             "broadcast": lambda: dist.broadcast(buffer, src=ranks[0], group=group),
             "reduce": lambda: [dist.reduce(parts[r], dst=ranks[r], group=group) for r in range(size)]}
    spec, messages = comm_counter.OPS[PROBED[kind]], size if kind == "reduce" else 1
    sent = messages * comm_counter.bytes_sent(spec, buffer.numel() * buffer.element_size() // messages, size)
    return calls[kind], sent, messages


def _timed(call, cuda: bool, device: torch.device, group) -> float:
    """Seconds of one `call`, every rank starting together."""
    dist.barrier(group=group)
    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    call()
    if cuda:
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def fastest_seconds(call, group, device: torch.device, repeats: int = REPEATS) -> float:
    """This rank's shortest wall time of `call` over up to `repeats` runs after a warm-up: as many as fit
    POINT_BUDGET_S by the warm-up's time (the slowest rank's, so that all run the same number), at least
    MIN_REPEATS. The shortest, not the median: on shared cores a run is stretched when either rank is
    pre-empted in it, and that only ever adds time (2 gloo ranks, 1 MiB all-reduce: the two ranks' clocks
    differ by 0.04-0.11 ms at the median, while both swing from 0.45 to 3-8 ms together)."""
    cuda = device.type == "cuda"
    warm_up = torch.tensor([_timed(call, cuda, device, group)], dtype=torch.float64, device=device)
    dist.all_reduce(warm_up, op=dist.ReduceOp.MAX, group=group)
    fit_budget = int(POINT_BUDGET_S / max(warm_up.item(), 1e-9))
    runs = max(min(repeats, MIN_REPEATS), min(repeats, fit_budget))
    return min(_timed(call, cuda, device, group) for _ in range(runs))


def probe_link(group, device: torch.device, backend: str, repeats: int = REPEATS,
               buffers: dict[str, int] | None = None) -> LinkCosts:
    """Latency and seconds per byte sent of each kind of collective on `group` (None: the default group),
    from the fastest runs (`fastest_seconds`) at SMALL float32 elements and at `buffers[kind]` (`probe_buffers`;
    None: every kind of PROBED, reduce included, at LARGE; a kind left out: LARGE, reduce not probed). Every rank
    of the group calls it at the same time (it runs collectives); all get the same costs, the largest any rank
    measured. p2p sends are not probed (a point-to-point pair would leave the group's other ranks idle): they take
    the broadcast's cost, one rank sending a buffer to the others. A group of one rank sends nothing: zero costs, nothing run.
    `backend` is the group's (gloo, nccl); the measured costs already include what it does on the wire. The
    result's `seconds` is how long the probe took on this rank."""
    started = time.perf_counter()
    size = dist.get_world_size(group)
    buffers = dict.fromkeys(PROBED, LARGE) if buffers is None else {
        kind: buffers.get(kind, LARGE) for kind in PROBED if kind != "reduce" or "reduce" in buffers}
    if size == 1:
        return LinkCosts({kind: CollectiveCost(0.0, 0.0) for kind in (*TRAFFIC_KINDS, *buffers)}, source="probe",
                         seconds=0.0)
    fitted = []
    with warnings.catch_warnings():
        # torch 2.13 deprecates the two functions DeepSpeed's ZeRO calls, the ones timed here
        deprecated = r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)`"
        warnings.filterwarnings("ignore", message=deprecated, category=FutureWarning)
        for kind, large in buffers.items():
            points = []
            for elements in (SMALL, large):
                call, sent, messages = _collective(kind, elements - elements % size, group, device)
                points.append((sent, fastest_seconds(call, group, device, repeats)))
            cost = fit(*points)
            fitted += [cost.latency_s / messages, cost.seconds_per_byte]  # latency per message issued
    # one collective agrees on the numbers: every rank then predicts the same step time
    agreed = torch.tensor(fitted, dtype=torch.float64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    values = agreed.tolist()
    assert all(math.isfinite(v) and v >= 0 for v in values), f"{backend} link probe measured {values}"
    costs = {kind: CollectiveCost(values[2 * i], values[2 * i + 1]) for i, kind in enumerate(buffers)}
    costs["p2p"] = costs["broadcast"]
    order = [*TRAFFIC_KINDS, *(kind for kind in costs if kind not in TRAFFIC_KINDS)]
    return LinkCosts({kind: costs[kind] for kind in order}, source="probe", seconds=time.perf_counter() - started)
