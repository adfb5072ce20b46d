"""What each kind of collective costs on a group, measured at start-up: latency and seconds per byte sent.

`probe_link` times all-reduce, reduce-scatter, all-gather and broadcast at two buffer sizes and fits
seconds = latency + seconds_per_byte x bytes sent, bytes sent as megatron/comm_counter.py counts them (the
ZeRO paper's volume), so the fitted seconds_per_byte already holds what the backend's wire costs per such
byte (gloo's reduce-scatter sends about what its all-reduce sends; docs/zero-tradeoff.md). The step-time
model (megatron/model/accounting/step_time.py) multiplies it by the bytes and messages a step sends.

The probe's collectives are issued outside comm_counter's counting(), so they are not counted as training
traffic.
"""
from __future__ import annotations

import math
import statistics
import time
import warnings

import torch
import torch.distributed as dist

from megatron import comm_counter
from megatron.model.accounting.step_time import CollectiveCost, LinkCosts
from megatron.model.accounting.traffic import TRAFFIC_KINDS

# float32 elements of the two buffers: 64 KiB (latency-bound) and 4 MiB (bandwidth-bound)
SMALL, LARGE = 16 * 1024, 1024 * 1024
REPEATS = 7  # timed repetitions per kind and size, after one warm-up
# the torch.distributed function each kind is timed with, as megatron/comm_counter.py names its buffer
PROBED = {"all_reduce": "all_reduce", "reduce_scatter": "reduce_scatter_tensor",
          "all_gather": "all_gather_into_tensor", "broadcast": "broadcast"}


def fit(small: tuple[float, float], large: tuple[float, float]) -> CollectiveCost:
    """The line through two (bytes sent, seconds) points, kept physical when noise tilts it: a slope that is
    not positive becomes the large point's seconds per byte, a negative intercept zero latency."""
    (b1, t1), (b2, t2) = small, large
    slope = (t2 - t1) / (b2 - b1)
    if not slope > 0:
        return CollectiveCost(latency_s=0.0, seconds_per_byte=t2 / b2)
    return CollectiveCost(latency_s=max(0.0, t1 - slope * b1), seconds_per_byte=slope)


def _collective(kind: str, elements: int, group, device: torch.device):
    """A call of `kind` on a fresh float32 buffer of `elements` and the bytes comm_counter says it sends."""
    size = dist.get_world_size(group)
    buffer = torch.ones(elements, device=device)
    part = torch.empty(elements // size, device=device)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    calls = {"all_reduce": lambda: dist.all_reduce(buffer, group=group),
             "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, buffer, group=group),
             "all_gather": lambda: dist.all_gather_into_tensor(buffer, part, group=group),
             "broadcast": lambda: dist.broadcast(buffer, src=src, group=group)}
    sent = comm_counter.bytes_sent(comm_counter.OPS[PROBED[kind]], buffer.numel() * buffer.element_size(), size)
    return calls[kind], sent


def _median_seconds(call, group, device: torch.device, repeats: int) -> float:
    """Median wall time of `call` over `repeats` runs after a warm-up, every rank starting together."""
    cuda = device.type == "cuda"
    call()
    seconds = []
    for _ in range(repeats):
        dist.barrier(group=group)
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        call()
        if cuda:
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def probe_link(group, device: torch.device, backend: str, repeats: int = REPEATS) -> LinkCosts:
    """Latency and seconds per byte sent of each kind of collective on `group` (None: the default group),
    from the medians at SMALL and LARGE float32 elements. Every rank of the group calls it at the same time
    (it runs collectives); all get the same costs, the largest any rank measured. p2p sends are not probed
    (a point-to-point pair would leave the group's other ranks idle): they take the broadcast's cost, one rank
    sending a buffer to the others. A group of one rank sends nothing: zero costs, nothing run. `backend` is
    the group's (gloo, nccl); the measured costs already include what it does on the wire."""
    size = dist.get_world_size(group)
    if size == 1:
        return LinkCosts({kind: CollectiveCost(0.0, 0.0) for kind in TRAFFIC_KINDS}, source="probe")
    fitted = []
    with warnings.catch_warnings():
        # torch 2.13 deprecates the two functions DeepSpeed's ZeRO calls, the ones timed here
        deprecated = r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)`"
        warnings.filterwarnings("ignore", message=deprecated, category=FutureWarning)
        for kind in PROBED:
            points = []
            for elements in (SMALL, LARGE):
                call, sent = _collective(kind, elements - elements % size, group, device)
                points.append((sent, _median_seconds(call, group, device, repeats)))
            cost = fit(*points)
            fitted += [cost.latency_s, cost.seconds_per_byte]
    # one collective agrees on the numbers: every rank then predicts the same step time
    agreed = torch.tensor(fitted, dtype=torch.float64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    values = agreed.tolist()
    assert all(math.isfinite(v) and v >= 0 for v in values), f"{backend} link probe measured {values}"
    costs = {kind: CollectiveCost(values[2 * i], values[2 * i + 1]) for i, kind in enumerate(PROBED)}
    costs["p2p"] = costs["broadcast"]
    return LinkCosts({kind: costs[kind] for kind in TRAFFIC_KINDS}, source="probe")
