"""A step's time, predicted: compute, collectives and offload transfers, less what overlaps.

The inputs are rates measured at start-up by megatron/compute_probe.py and megatron/comm_probe.py (or a
link the user describes with flags), never the run's own step time.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CollectiveCost:
    """One kind of collective on one group: seconds = latency_s + seconds_per_byte * bytes sent, bytes sent
    as megatron/comm_counter.py counts them (the ZeRO paper's volume, not what the wire carries)."""
    latency_s: float
    seconds_per_byte: float

    def seconds(self, bytes_sent: float, messages: int) -> float:
        return messages * self.latency_s + bytes_sent * self.seconds_per_byte


@dataclass(frozen=True)
class LinkCosts:
    """What each kind of collective (accounting.TRAFFIC_KINDS) costs on the data-parallel group."""
    costs: dict[str, CollectiveCost]
    source: str  # "probe" (measured at start-up) or "flags" (the user's bandwidth and latency)


@dataclass(frozen=True)
class ComputeRates:
    """The rank's own speeds, measured at start-up with the run's shapes, dtype and optimizer."""
    flops_per_s: float  # hardware FLOPs per second of a transformer layer's forward and backward
    optimizer_s_per_element: float  # the optimizer's step per parameter element where it runs
    host_copy_bytes_per_s: float  # accelerator <-> host copies (offload)
    nvme_bytes_per_s: float | None = None  # reads and writes of the swap folder (ZeRO-Infinity); None: no NVMe


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step, by part; `overlap` is the communication hidden behind compute."""
    compute: float
    communication: float
    offload: float
    overlap: float = 0.0

    @property
    def total(self) -> float:
        return self.compute + self.communication + self.offload - self.overlap
