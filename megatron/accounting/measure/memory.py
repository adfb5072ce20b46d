"""Memory measurement for the log lines: what this rank really holds.

On CUDA the accelerator numbers are torch.cuda.memory_allocated / max_memory_allocated. On the
CPU there is no allocator counter, so "MemAllocated" is the process's live tensor memory: the
sum of the unique storages of all tensors the garbage collector can see, sampled at log time
(MaxMemAllocated is the largest such sample), less --checkpoint-in-cpu's host tier (host_tier_bytes).
HostRSS is the process's resident set from psutil. The step's peak on CPU ranks, which no sample at log time
sees, is measured op by op over the first micro-batch of the first step (LiveBytes, step_peak_bytes).
"""
import contextlib
import gc
import itertools
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megatron.core.tensor_parallel.activation_offload import HostTensor


def _storage_key(tensor: torch.Tensor):
    storage = tensor.untyped_storage()
    return storage.device, storage.data_ptr(), storage.nbytes()


def unique_storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one flat buffer count once). A tensor without
    memory of its own is skipped: torch.compile's tracing (--compile) leaves tensors whose storage has no data
    pointer (the plain tensors inside its functional wrappers), which it keeps alive in its caches."""
    seen = {}
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta" and tensor.numel() > 0:
            try:
                key = _storage_key(tensor)
            except RuntimeError:  # "Cannot access data pointer of Tensor (e.g. FakeTensor, FunctionalTensor)"
                continue
            seen[key[:2]] = max(seen.get(key[:2], 0), key[2])
    return sum(seen.values())


def _tracing_tensor_types() -> tuple[type, ...]:
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor
    return FakeTensor, FunctionalTensor


# torch.compile's stand-ins for tensors while it traces (--compile): no memory of their own
_TRACING_TENSORS = _tracing_tensor_types()


def _live_tensors(wanted) -> Iterator[torch.Tensor]:
    # The garbage collector's objects filtered by type at C speed (map, compress): a Python loop over them, a
    # few hundred thousand in a rank, took 0.1 s a sample. type() also reads no attribute, so dead weak proxies
    # and lazily deprecated module attributes neither raise nor warn.
    objects = gc.get_objects()
    tensor_types = {kind for kind in set(map(type, objects)) if issubclass(kind, torch.Tensor) and wanted(kind)}
    return itertools.compress(objects, map(tensor_types.__contains__, map(type, objects)))


def live_tensor_bytes() -> int:
    """The live tensors' bytes on the accelerator's side: the host tier of --checkpoint-in-cpu (HostTensor, host
    memory even on CPU ranks, where it is an emulation) is left out."""
    return unique_storage_bytes(_live_tensors(lambda kind: not issubclass(kind, (*_TRACING_TENSORS, HostTensor))))


def host_tier_bytes() -> int:
    """Bytes of the live tensors of --checkpoint-in-cpu's host tier: the offloaded layer inputs (pinned host
    memory on CUDA; on CPU ranks the emulation's copies, megatron/core/tensor_parallel/activation_offload.py)."""
    return unique_storage_bytes(_live_tensors(lambda kind: issubclass(kind, HostTensor)))


@dataclass
class MemoryTracker:
    on_cuda: bool
    max_cpu_tensor_bytes: int = 0
    max_rss: int = 0
    process: psutil.Process = field(default_factory=psutil.Process)

    def sample(self, end_interval: bool = True) -> dict:
        """end_interval=False: a reading inside a logging interval (the model-state line), which
        leaves the interval's CUDA peak running."""
        rss = self.process.memory_info().rss
        self.max_rss = max(self.max_rss, rss)
        if self.on_cuda:
            allocated, max_allocated = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
            # The peak of this logging interval, as Megatron-DeepSpeed's see_memory_usage reports it:
            # the next interval's peak starts from here, so a one-off spike shows in its own interval only.
            if end_interval:
                torch.cuda.reset_peak_memory_stats()
        else:
            allocated = live_tensor_bytes()
            self.max_cpu_tensor_bytes = max(self.max_cpu_tensor_bytes, allocated)
            max_allocated = self.max_cpu_tensor_bytes
        return {"allocated": allocated, "max_allocated": max_allocated, "rss": rss, "max_rss": self.max_rss}


# The private DeepSpeed (0.19.8) attributes read below, by optimizer class: the fp32 master partitions and the
# gradient buffers ZeRO keeps. Were DeepSpeed to rename one, a silent getattr default would drop it from the
# measurement; instead a missing one raises (tests/test_training.py and the driver runs cover every class).
# FP16_UnfusedOptimizer is stage 0 in bf16 (or fp16) without a pipeline: whole fp32 copies, one list per group
# (with experts, its subclass megatron/stage0_optimizer.py's: a class is known by the first of its bases named here).
_FP32_MASTER = {"DeepSpeedZeroOptimizer": "single_partition_of_fp32_groups",
                "DeepSpeedZeroOptimizer_Stage3": "fp32_partitioned_groups_flat",
                "BF16_Optimizer": "fp32_groups_flat_partition",
                "FP16_UnfusedOptimizer": "fp32_groups"}
# Stages 1-2 accumulate the gradients of their partition's parameters in all_grad_tensors between micro-batches;
# the bf16 optimizer (stage 1 in bf16, whose gradients accumulate in fp32) keeps every gradient in a flat buffer
# of the accumulation dtype next to the bf16 ones.
_GRADIENT_BUFFERS = {"DeepSpeedZeroOptimizer": ("averaged_gradients", "all_grad_tensors"),
                     "DeepSpeedZeroOptimizer_Stage3": ("averaged_gradients", "grad_partitions_flat_buffer"),
                     "BF16_Optimizer": ("fp32_groups_gradients_flat",)}
# With the optimizer offloaded (to host memory or NVMe) stage 3 allocates its gradient accumulation buffer on the
# optimizer's device, the host (pinned on request); the accelerator keeps only the reduce buckets. Stages 1 and 2
# copy each reduced bucket straight into the host's fp32 partition gradient, which optimizer_bytes counts.
_HOST_GRADIENT_BUFFERS = {"DeepSpeedZeroOptimizer_Stage3": ("grad_partitions_flat_buffer",)}


class DeepSpeedInternalsError(RuntimeError):
    """The installed DeepSpeed lacks a private attribute the memory measurement reads (a bug to fix here)."""


def _private(optimizer, name: str):
    try:
        return getattr(optimizer, name)
    except AttributeError:
        import deepspeed
        raise DeepSpeedInternalsError(
            f"DeepSpeed {deepspeed.__version__}: {type(optimizer).__name__} has no attribute {name!r}; "
            "megatron/accounting/measure/memory.py reads it to measure model-state memory and needs updating") from None


def deepspeed_class_name(optimizer) -> str:
    """The name of the first class of `optimizer`'s bases (itself first) that this file knows, else its own."""
    names = [cls.__name__ for cls in type(optimizer).__mro__]
    return next((name for name in names if name in _FP32_MASTER), names[0])


def _deepspeed_optimizer(engine):
    """The ZeRO or bf16 optimizer whose private buffers are measured; None for a plain torch optimizer."""
    optimizer = engine.optimizer
    known = deepspeed_class_name(optimizer) in _FP32_MASTER
    if engine.zero_optimization() and not known:
        raise DeepSpeedInternalsError(f"ZeRO optimizer {type(optimizer).__name__} is not one "
                                      "megatron/accounting/measure/memory.py "
                                      f"knows ({', '.join(_FP32_MASTER)})")
    return optimizer if known else None


def param_bytes(engine) -> int:
    """Parameters this rank holds; at ZeRO-3 the partitions (ds_tensor), not the gathered tensors."""
    params = list(engine.module.parameters())
    if engine.zero_optimization_stage() == 3:
        return unique_storage_bytes(p.ds_tensor for p in params)
    return unique_storage_bytes(params)


def gradient_buffers(optimizer_name: str, offload_optimizer: bool) -> dict[str, tuple[str, ...]]:
    """The optimizer's gradient buffers by where DeepSpeed keeps them, "accelerator" or "host". On CPU ranks
    both are host memory, so the place comes from the configuration, not from the tensors' device."""
    names = _GRADIENT_BUFFERS.get(optimizer_name, ())
    host = tuple(name for name in _HOST_GRADIENT_BUFFERS.get(optimizer_name, ()) if offload_optimizer)
    return {"accelerator": tuple(name for name in names if name not in host), "host": host}


def grad_bytes(engine) -> int:
    """Gradients this rank holds on the accelerator now (call after a backward, before engine.step())."""
    tensors = [p.grad for p in engine.module.parameters() if p.grad is not None]
    return unique_storage_bytes(tensors + _gradient_buffer_tensors(engine, "accelerator"))


def host_gradient_bytes(engine) -> int:
    """Gradients DeepSpeed keeps in host memory beside the offloaded optimizer (stage 3's accumulation buffer)."""
    return unique_storage_bytes(_gradient_buffer_tensors(engine, "host"))


def _gradient_buffer_tensors(engine, where: str) -> list[torch.Tensor]:
    optimizer = _deepspeed_optimizer(engine)
    tensors = []
    for name in gradient_buffers(deepspeed_class_name(optimizer), engine.zero_use_cpu_optimizer())[where]:
        buffers = _private(optimizer, name)
        if isinstance(buffers, dict):  # parameter group -> list of gradients (or None)
            tensors.extend(t for grads in buffers.values() for t in grads or [])
        elif isinstance(buffers, list):  # one flat buffer per parameter group
            tensors.extend(buffers)
        elif buffers is not None:
            tensors.append(buffers)
    return tensors


def optimizer_bytes(engine) -> int:
    """Optimizer states plus the fp32 master partitions ZeRO (or the bf16 and stage-0 16-bit optimizers) keeps next to them, and
    those partitions' gradients where they exist between steps (with the optimizer offloaded)."""
    optimizer = _deepspeed_optimizer(engine)
    inner = optimizer.optimizer if optimizer is not None else engine.optimizer
    inner = getattr(inner, "optimizer", inner)  # the fp16 wrapper at stage 0
    tensors = [value for state in inner.state.values() for value in state.values()]
    if optimizer is not None:
        masters = _private(optimizer, _FP32_MASTER[deepspeed_class_name(optimizer)]) or []
        # FP16_UnfusedOptimizer keeps a list of fp32 copies per parameter group
        masters = [t for entry in masters for t in (entry if isinstance(entry, list) else [entry])
                   if isinstance(t, torch.Tensor)]
        tensors.extend(masters)
        # the master partitions' fp32 gradients: kept next to them when the optimizer is offloaded; the bf16
        # optimizer's are views of its gradient buffer, which grad_bytes counts
        if deepspeed_class_name(optimizer) != "BF16_Optimizer":
            tensors.extend(t.grad for t in masters if t.grad is not None)
    return unique_storage_bytes(tensors)


def swap_file_bytes(nvme_path: str, rank: int) -> int:
    """Bytes of the files DeepSpeed's NVMe offload keeps for `rank` (<nvme_path>/zero_stage_3/<kind>/rank<r>/):
    its optimizer states, their gradient and its parameter partitions."""
    files = Path(nvme_path).glob(f"zero_stage_*/*/rank{rank}/*")
    return sum(path.stat().st_size for path in files if path.is_file())


@contextlib.contextmanager
def saved_activation_bytes(module: torch.nn.Module) -> Iterator[list[int]]:
    """Measure the activations of the forward run inside: every tensor autograd saves for the backward
    passes through a saved_tensors_hooks pack hook, which records its storage; parameters and views of
    them (a matmul saves its weight) are not activations. On exit the yielded list gets the bytes of the
    distinct storages recorded (a saved tensor keeps its storage alive, so no address is reused meanwhile)."""
    def weight_storages() -> set[int]:
        # at ZeRO-3 a parameter's storage is its gathered buffer, there only while it is gathered
        return {p.untyped_storage().data_ptr() for p in module.parameters()}

    weights = weight_storages()
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal weights
        if not isinstance(tensor, torch.nn.Parameter) and tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in weights:
                weights = weight_storages()
            if storage.data_ptr() not in weights:
                storages[storage.data_ptr()] = max(storages.get(storage.data_ptr(), 0), storage.nbytes())
        return tensor

    result: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield result
    result.append(sum(storages.values()))


class LiveBytes(TorchDispatchMode):
    """The bytes of the live storages of every tensor an op makes inside (views count their storage once), sampled
    after each op of the forward and the backward, and their peak: on CPU ranks, which have no allocator counter,
    the step's peak beside memory_per_rank's total less the model states. A tensor autograd keeps from C++ keeps
    its Python object, so its storage stays counted while it lives. Left out: the host tier (HostTensor), tensors
    made outside (the weights, the inputs), the storages in `excluded`, and those handed to exclude() later, over
    their whole life (the gradients a first backward makes: model states, not known as such when they are made)."""

    def __init__(self, excluded: Iterable[int] = ()):
        super().__init__()
        self.excluded = set(excluded)
        self.tensors, self.storages, self.live, self.samples = {}, {}, 0, []
        self.born: dict[int, int] = {}  # storage -> the sample it was first counted in
        self.left_out: list[tuple[int, int, int]] = []  # (first sample, last sample + 1, bytes) of excluded ones
        self.closed_at: int | None = None  # the samples from here on are not in the peak (close())

    @property
    def peak(self) -> int:
        """The largest sample before close(), the storages handed to exclude() left out over their whole life."""
        delta = [0] * (len(self.samples) + 1)
        for first, end, nbytes in self.left_out + [(self.born[key], len(self.samples), self.storages[key][0])
                                                   for key in self.excluded if key in self.storages]:
            delta[first] -= nbytes
            delta[end] += nbytes
        less = itertools.accumulate(delta[:-1])
        return max((sample + dropped for sample, dropped in zip(self.samples[:self.closed_at], less)), default=0)

    def close(self) -> None:
        """Leave the ops from here on out of the peak (they are still tracked, so exclude() keeps working)."""
        if self.closed_at is None:
            self.closed_at = len(self.samples)

    def exclude(self, tensors: Iterable[torch.Tensor | None]) -> None:
        """Leave the storages of `tensors` out of every sample, those already taken included."""
        self.excluded.update(t.untyped_storage().data_ptr() for t in tensors if isinstance(t, torch.Tensor))

    def _forget(self, ident: int, key: int) -> None:
        self.tensors.pop(ident, None)
        nbytes, count = self.storages[key]
        self.storages[key] = (nbytes, count - 1)
        if count == 1:
            del self.storages[key]
            self.live -= nbytes
            first = self.born.pop(key)
            if key in self.excluded:  # its address may be reused by a storage that is not
                self.excluded.discard(key)
                self.left_out.append((first, len(self.samples), nbytes))

    def _track(self, tensor: torch.Tensor) -> None:
        if id(tensor) in self.tensors or isinstance(tensor, HostTensor) or tensor.numel() == 0:
            return
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.excluded and key not in self.storages:
            return
        nbytes, count = self.storages.get(key, (storage.nbytes(), 0))
        if count == 0:
            self.live += nbytes
            self.born[key] = len(self.samples)
        self.storages[key] = (nbytes, count + 1)
        self.tensors[id(tensor)] = weakref.ref(tensor, lambda _, ident=id(tensor), key=key: self._forget(ident, key))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self._track(tensor)
        self.samples.append(self.live)
        return out


@contextlib.contextmanager
def step_peak_bytes(engine) -> Iterator[list[int]]:
    """Measure the peak of what the forward and autograd's backward run inside hold beyond the model states, on
    CPU ranks (LiveBytes): memory_per_rank's total less its model_states is its prediction (the kept activations,
    the backward's recomputed layer and MLP tile, its gradients of activations, the output-layer buffer). The
    measurement ends with autograd's backward: ZeRO-1's gradient reduction, which engine.backward runs after it
    (its flat buffers, with the activations freed), is not in the figure nor in the prediction; with gradient hooks
    that reduce during the backward (ZeRO-2, overlap_comm) those are in. Left out over their whole life: the
    parameters, every tensor that becomes a parameter's .grad (seen by a post-accumulate-grad hook, so a gradient
    DeepSpeed later reduces and frees counts as held, as the predicted grads do) and DeepSpeed's gradient buffers
    after it. ZeRO-3's gathered parameters are made inside, so they count. On exit the yielded list gets the
    bytes. One dispatch per op in Python: meant for one micro-batch of the probed step."""
    params = [param for param in engine.module.parameters() if param.requires_grad]
    live = LiveBytes(param.untyped_storage().data_ptr() for param in params)

    def accumulated(param: torch.nn.Parameter) -> None:
        # after DeepSpeed's own hook (registered first), which at ZeRO-2 may have moved the gradient into its
        # partition's buffer: the buffer is the held gradients' storage from then on, freed before the backward ends
        live.exclude([param.grad, _partition_gradients(engine)])
        if not ending:  # autograd calls it once its backward is done, before engine.backward goes on
            torch.autograd.Variable._execution_engine.queue_callback(live.close)
            ending.append(True)

    ending: list[bool] = []
    hooks = [param.register_post_accumulate_grad_hook(accumulated) for param in params]
    result: list[int] = []
    try:
        with live:
            yield result
    finally:
        for hook in hooks:
            hook.remove()
    live.exclude([param.grad for param in params] + _gradient_buffer_tensors(engine, "accelerator")
                 + _gradient_buffer_tensors(engine, "host"))
    result.append(live.peak)


def _partition_gradients(engine) -> torch.Tensor | None:
    """ZeRO-2's contiguous buffer of its partition's gradients (DeepSpeed 0.19.8's grads_in_partition, made whole at
    the backward's first gradient hook, None at stage 1 and once released): each gradient of the partition is copied
    into it and the parameter's .grad made a view of it, so it is the held gradients, a model state, which
    step_peak_bytes leaves out (counted, it put 26.6 MiB more in the GPT-2 vocabulary's peak at the tiny shape)."""
    optimizer = _deepspeed_optimizer(engine)
    if optimizer is None or deepspeed_class_name(optimizer) != "DeepSpeedZeroOptimizer":
        return None
    return _private(optimizer, "grads_in_partition") if optimizer.contiguous_gradients else None
