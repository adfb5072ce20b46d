"""Memory measurement for the log lines: what this rank really holds.

On CUDA the accelerator numbers are torch.cuda.memory_allocated / max_memory_allocated. On the
CPU there is no allocator counter, so "MemAllocated" is the process's live tensor memory: the
sum of the unique storages of all tensors the garbage collector can see, sampled at log time
(MaxMemAllocated is the largest such sample). HostRSS is the process's resident set from psutil.
"""
import gc
import warnings
from dataclasses import dataclass, field

import psutil
import torch


def _storage_key(tensor: torch.Tensor):
    storage = tensor.untyped_storage()
    return storage.device, storage.data_ptr(), storage.nbytes()


def unique_storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one flat buffer count once)."""
    seen = {}
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta" and tensor.numel() > 0:
            key = _storage_key(tensor)
            seen[key[:2]] = max(seen.get(key[:2], 0), key[2])
    return sum(seen.values())


def live_tensor_bytes() -> int:
    def tensors():
        for obj in gc.get_objects():
            try:
                if isinstance(obj, torch.Tensor):
                    yield obj
            except ReferenceError:  # dead weak proxies raise on isinstance
                continue
    # isinstance on some lazily-deprecated module attributes emits FutureWarnings; they are not ours
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return unique_storage_bytes(tensors())


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
_FP32_MASTER = {"DeepSpeedZeroOptimizer": "single_partition_of_fp32_groups",
                "DeepSpeedZeroOptimizer_Stage3": "fp32_partitioned_groups_flat",
                "BF16_Optimizer": "fp32_groups_flat_partition"}
_GRADIENT_BUFFERS = {"DeepSpeedZeroOptimizer": ("averaged_gradients",),
                     "DeepSpeedZeroOptimizer_Stage3": ("averaged_gradients", "grad_partitions_flat_buffer")}


class DeepSpeedInternalsError(RuntimeError):
    """The installed DeepSpeed lacks a private attribute the memory measurement reads (a bug to fix here)."""


def _private(optimizer, name: str):
    try:
        return getattr(optimizer, name)
    except AttributeError:
        import deepspeed
        raise DeepSpeedInternalsError(
            f"DeepSpeed {deepspeed.__version__}: {type(optimizer).__name__} has no attribute {name!r}; "
            "megatron/memory.py reads it to measure model-state memory and needs updating") from None


def _deepspeed_optimizer(engine):
    """The ZeRO or bf16 optimizer whose private buffers are measured; None for a plain torch optimizer."""
    optimizer = engine.optimizer
    known = type(optimizer).__name__ in _FP32_MASTER
    if engine.zero_optimization() and not known:
        raise DeepSpeedInternalsError(f"ZeRO optimizer {type(optimizer).__name__} is not one megatron/memory.py "
                                      f"knows ({', '.join(_FP32_MASTER)})")
    return optimizer if known else None


def param_bytes(engine) -> int:
    """Parameters this rank holds; at ZeRO-3 the partitions (ds_tensor), not the gathered tensors."""
    params = list(engine.module.parameters())
    if engine.zero_optimization_stage() == 3:
        return unique_storage_bytes(p.ds_tensor for p in params)
    return unique_storage_bytes(params)


def grad_bytes(engine) -> int:
    """Gradients this rank holds after the last backward of a step (call before engine.step())."""
    tensors = [p.grad for p in engine.module.parameters() if p.grad is not None]
    optimizer = _deepspeed_optimizer(engine)
    for name in _GRADIENT_BUFFERS.get(type(optimizer).__name__, ()):
        buffers = _private(optimizer, name)
        if isinstance(buffers, dict):  # averaged_gradients: parameter group -> list of gradient partitions
            tensors.extend(t for grads in buffers.values() for t in grads or [])
        elif buffers is not None:
            tensors.append(buffers)
    return unique_storage_bytes(tensors)


def optimizer_bytes(engine) -> int:
    """Optimizer states plus the fp32 master partitions ZeRO (or the bf16 optimizer) keeps next to them."""
    optimizer = _deepspeed_optimizer(engine)
    inner = optimizer.optimizer if optimizer is not None else engine.optimizer
    inner = getattr(inner, "optimizer", inner)  # the fp16 wrapper at stage 0
    tensors = [value for state in inner.state.values() for value in state.values()]
    if optimizer is not None:
        tensors.extend(t for t in _private(optimizer, _FP32_MASTER[type(optimizer).__name__]) or []
                       if isinstance(t, torch.Tensor))
    return unique_storage_bytes(tensors)
