"""Bytes each rank sends through collectives, counted where every collective is issued.

DeepSpeed (ZeRO, its pipeline engine, through deepspeed.comm's TorchBackend) and our tensor-parallel
mappings all end in torch.distributed's functions, so `install()` wraps those (the package's
attributes and distributed_c10d's, which torch's own functions call) with a byte counter. DeepSpeed's
comms logger is not used: it synchronises the accelerator after every op to time it, which slows the
run; counting is a few attribute reads per call (bench/bench_comm_counting.py measures the cost).

"Bytes sent" is the bandwidth-optimal volume each rank of an n-rank group sends, averaged over its
ranks (docs/zero-tradeoff.md): (n-1)/n of the whole buffer for a reduce-scatter (its input), an
all-gather (its output), a reduce and a broadcast; twice that for an all-reduce (a reduce-scatter
then an all-gather, as a ring does it); the whole tensor for a point-to-point send, nothing for a
receive. megatron/accounting/predict/traffic.py predicts traffic with the same definition.

One op can call another (send calls isend, all_gather_into_tensor calls all_gather_single): only
the outermost counted call counts, so nothing is counted twice.

The counter also times what the rank spends blocked in collectives, per kind: the call itself, and for
an asynchronous op (async_op=True) its wait(). On CPU ranks that is host time. On CUDA, where a call
returns once the op is queued, it is what the compute stream (the device's current stream when training
starts, `time_on_cuda`) waits for, timed with CUDA events on it and read at the next logging interval (the
training loop synchronises there anyway): a collective issued, or a wait() called, on the compute stream,
and the compute stream's wait_stream() on a side stream that collectives were issued on since its last such
wait (ZeRO-3 waits so for its all-gathers, ZeRO 1-2's overlap_comm before each bucket's reduction). A
collective issued on a side stream (DeepSpeed's overlap_comm reductions, ZeRO-3's gathers and
reduce-scatters) runs behind compute: its bytes count, its own time does not.
"""
from __future__ import annotations

import contextlib
import inspect
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "p2p")
# kinds only some layouts issue, counted (and shown in the comm line) from their first call: DeepSpeed-Ulysses'
# all-to-alls (docs/long-sequences.md); every other run's lines keep KINDS only
LAYOUT_KINDS = ("all_to_all",)


@dataclass(frozen=True)
class _OpSpec:
    kind: str
    tensors: str  # the parameter holding the whole buffer (a tensor or a list of tensors)
    factor: str  # "ring": (n-1)/n of the buffer; "all_reduce": 2(n-1)/n; "whole": the buffer itself


# Every torch.distributed function that moves tensor data in training; receives send nothing.
OPS: dict[str, _OpSpec] = {
    "all_reduce": _OpSpec("all_reduce", "tensor", "all_reduce"),
    "all_reduce_coalesced": _OpSpec("all_reduce", "tensors", "all_reduce"),
    "reduce_scatter": _OpSpec("reduce_scatter", "input_list", "ring"),
    "reduce_scatter_tensor": _OpSpec("reduce_scatter", "input", "ring"),
    "reduce_scatter_single": _OpSpec("reduce_scatter", "input", "ring"),
    "_reduce_scatter_base": _OpSpec("reduce_scatter", "input", "ring"),
    # a reduce to each partition's owner in turn is how ZeRO 1/2 scatter gradients without reduce_scatter
    "reduce": _OpSpec("reduce_scatter", "tensor", "ring"),
    "all_gather": _OpSpec("all_gather", "tensor_list", "ring"),
    "all_gather_into_tensor": _OpSpec("all_gather", "output_tensor", "ring"),
    "all_gather_single": _OpSpec("all_gather", "output_tensor", "ring"),
    "_all_gather_base": _OpSpec("all_gather", "output_tensor", "ring"),
    "all_gather_coalesced": _OpSpec("all_gather", "output_tensor_lists", "ring"),
    "broadcast": _OpSpec("broadcast", "tensor", "ring"),
    "send": _OpSpec("p2p", "tensor", "whole"),
    "isend": _OpSpec("p2p", "tensor", "whole"),
    # each rank keeps 1/n of its input and sends the rest
    "all_to_all_single": _OpSpec("all_to_all", "input", "ring"),
    "all_to_all": _OpSpec("all_to_all", "input_tensor_list", "ring"),
}


def tensor_bytes(value) -> int:
    """Bytes of a tensor, or of every tensor in a (nested) list of them."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


def bytes_sent(spec: _OpSpec, buffer_bytes: int, group_size: int) -> float:
    if spec.factor == "whole":
        return float(buffer_bytes)
    share = (group_size - 1) / group_size * buffer_bytes
    return 2.0 * share if spec.factor == "all_reduce" else share


@dataclass
class CommCounter:
    """Cumulative bytes this rank sent, and seconds it was blocked, per kind, while counting is on
    (see `counting`)."""
    sent: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))
    calls: dict[str, int] = field(default_factory=dict)  # per torch.distributed function name
    active: bool = False
    on_cuda: bool = False  # time with CUDA events on compute_stream instead of the host clock (`time_on_cuda`)
    compute_stream: object = None
    _side_streams: dict = field(default_factory=dict)  # side stream -> kind last issued on it, not yet waited for
    _seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))
    _pending_events: list = field(default_factory=list)  # (kind, start, end) CUDA events not yet read
    _depth: int = 0
    _group_sizes: dict = field(default_factory=dict)

    @contextlib.contextmanager
    def counting(self):
        """Count the collectives issued inside (the training step; evaluation and checkpoints stay out)."""
        previous, self.active = self.active, True
        try:
            yield self
        finally:
            self.active = previous

    def snapshot(self) -> dict[str, float]:
        return dict(self.sent)

    def seconds(self) -> dict[str, float]:
        """Seconds blocked per kind so far. On CUDA this reads the recorded events: call it after the
        device was synchronised, or it waits for them."""
        for kind, start, end in self._pending_events:
            end.synchronize()
            self._seconds[kind] = self._seconds.get(kind, 0.0) + start.elapsed_time(end) / 1000.0
        self._pending_events.clear()
        return dict(self._seconds)

    def group_size(self, group) -> int:
        size = self._group_sizes.get(group)
        if size is None:
            size = self._group_sizes[group] = dist.get_world_size(group)
        return size

    def record(self, name: str, spec: _OpSpec, buffer_bytes: int, group) -> None:
        self.sent[spec.kind] = self.sent.get(spec.kind, 0.0) + bytes_sent(spec, buffer_bytes, self.group_size(group))
        self.calls[name] = self.calls.get(name, 0) + 1

    def time_on_cuda(self, compute_stream) -> None:
        """Time with CUDA events what `compute_stream` (torch.cuda.current_stream() as training starts) waits for,
        its wait_stream() on side streams included: wraps its class's wait_stream (uninstall puts it back)."""
        self.on_cuda, self.compute_stream = True, compute_stream
        stream_class = type(compute_stream)
        original = getattr(stream_class.wait_stream, "zero_lab_original", stream_class.wait_stream)
        stream_class.wait_stream = _timed_wait_stream(original, self)

    def clock(self):
        """A start mark for `blocked`: the host clock, or a CUDA event recorded on the compute stream; None on a
        side stream, whose collectives run behind compute."""
        if not self.on_cuda:
            return time.perf_counter()
        if torch.cuda.current_stream() != self.compute_stream:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def blocked(self, kind: str, start) -> None:
        """Add the time from `start` (a `clock()` mark) to now to `kind`; on a side stream (start None) only
        note the stream, so that the compute stream's wait for it is timed as `kind`."""
        if not self.on_cuda:
            self._seconds[kind] = self._seconds.get(kind, 0.0) + time.perf_counter() - start
        elif start is None:
            self._side_streams[torch.cuda.current_stream()] = kind
        else:
            self._pending_events.append((kind, start, self.clock()))


class _TimedWork:
    """An asynchronous op's handle whose wait() adds the time it blocks to the counter; everything else
    is the handle's own."""

    def __init__(self, work, counter: CommCounter, kind: str):
        self._work, self._counter, self._kind = work, counter, kind

    def wait(self, *args, **kwargs):
        start = self._counter.clock()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            self._counter.blocked(self._kind, start)

    def __getattr__(self, name):
        return getattr(self._work, name)


def _timed_wait_stream(original, counter: CommCounter):
    """Stream.wait_stream timing, as the kind last issued there, the compute stream's wait for a side stream that
    counted collectives were issued on: events on the compute stream around the wait."""
    def wait_stream(self, stream):
        kind = counter._side_streams.pop(stream, None) if self == counter.compute_stream else None
        if kind is None or not counter.active:
            return original(self, stream)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(self)
        try:
            return original(self, stream)
        finally:
            end.record(self)
            counter._pending_events.append((kind, start, end))

    wait_stream.zero_lab_original = original
    return wait_stream


def since(now: dict[str, float], before: dict[str, float], iterations: int) -> dict[str, float]:
    """Bytes per iteration, per kind, between two snapshots."""
    return {kind: (now[kind] - before.get(kind, 0.0)) / max(1, iterations) for kind in now}


def wrap(original, spec: _OpSpec, counter: CommCounter):
    """`original` counting into `counter` (install() wraps torch.distributed's functions with it)."""
    name, names = original.__name__, list(inspect.signature(original).parameters)
    tensor_pos, group_pos = names.index(spec.tensors), names.index("group")

    def counted(*args, **kwargs):
        if not counter.active or counter._depth:
            return original(*args, **kwargs)
        value = args[tensor_pos] if len(args) > tensor_pos else kwargs.get(spec.tensors)
        group = args[group_pos] if len(args) > group_pos else kwargs.get("group")
        counter.record(name, spec, tensor_bytes(value), group)
        counter._depth += 1
        start = counter.clock()
        try:
            work = original(*args, **kwargs)
        finally:
            counter._depth -= 1
            counter.blocked(spec.kind, start)
        return work if work is None else _TimedWork(work, counter, spec.kind)

    # not __wrapped__: torch's own decorators set that, and uninstall must not unwrap them
    counted.zero_lab_original = original
    counted.__name__ = original.__name__
    return counted


def _rebind_deepspeed_backend() -> None:
    """DeepSpeed's TorchBackend looks up torch's all-gather and reduce-scatter functions once, when
    deepspeed.init_distributed runs; point those references at what torch.distributed holds now,
    so the order of install() and DeepSpeed's start-up does not matter."""
    comm = sys.modules.get("deepspeed.comm.comm")
    backend = getattr(comm, "cdb", None)
    for attr in ("all_gather_function", "reduce_scatter_function"):
        cached = getattr(backend, attr, None)
        if cached is not None:
            setattr(backend, attr, getattr(dist, getattr(cached, "zero_lab_original", cached).__name__))


def install(counter: CommCounter | None = None) -> CommCounter:
    """Wrap torch.distributed's collectives with `counter` (a new one by default) and return it.
    Installing twice replaces the first counter."""
    counter = counter or CommCounter()
    for name, spec in OPS.items():
        original = getattr(distributed_c10d, name, None)
        if original is None:  # absent from this torch version
            continue
        original = getattr(original, "zero_lab_original", original)
        counted = wrap(original, spec, counter)
        setattr(distributed_c10d, name, counted)
        if hasattr(dist, name):
            setattr(dist, name, counted)
    _rebind_deepspeed_backend()
    return counter


def uninstall() -> None:
    """Put torch.distributed's own functions, and torch.cuda.Stream's wait_stream, back (tests and the benchmark
    switch counting off)."""
    wait_stream = getattr(torch.cuda.Stream, "wait_stream", None)
    if hasattr(wait_stream, "zero_lab_original"):
        torch.cuda.Stream.wait_stream = wait_stream.zero_lab_original
    for name in OPS:
        for module in (distributed_c10d, dist):
            wrapped = getattr(module, name, None)
            if wrapped is not None and hasattr(wrapped, "zero_lab_original"):
                setattr(module, name, wrapped.zero_lab_original)
    _rebind_deepspeed_backend()
