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

    def sample(self) -> dict:
        rss = self.process.memory_info().rss
        self.max_rss = max(self.max_rss, rss)
        if self.on_cuda:
            allocated, max_allocated = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
        else:
            allocated = live_tensor_bytes()
            self.max_cpu_tensor_bytes = max(self.max_cpu_tensor_bytes, allocated)
            max_allocated = self.max_cpu_tensor_bytes
        return {"allocated": allocated, "max_allocated": max_allocated, "rss": rss, "max_rss": self.max_rss}


def _zero_optimizer(engine):
    return engine.optimizer if engine.zero_optimization() else None


def param_bytes(engine) -> int:
    """Parameters this rank holds; at ZeRO-3 the partitions (ds_tensor), not the gathered tensors."""
    params = list(engine.module.parameters())
    if engine.zero_optimization_stage() == 3:
        return unique_storage_bytes(p.ds_tensor for p in params)
    return unique_storage_bytes(params)


def grad_bytes(engine) -> int:
    """Gradients this rank holds after the last backward of a step (call before engine.step())."""
    tensors = [p.grad for p in engine.module.parameters() if p.grad is not None]
    zero = _zero_optimizer(engine)
    if zero is not None:
        for grads in getattr(zero, "averaged_gradients", {}).values():
            tensors.extend(grads or [])
        flat = getattr(zero, "grad_partitions_flat_buffer", None)
        if flat is not None:
            tensors.append(flat)
    return unique_storage_bytes(tensors)


def optimizer_bytes(engine) -> int:
    """Optimizer states plus the fp32 master partitions ZeRO keeps next to them."""
    zero = _zero_optimizer(engine)
    inner = zero.optimizer if zero is not None else engine.optimizer
    inner = getattr(inner, "optimizer", inner)  # bf16/fp16 wrappers at stage 0
    tensors = [value for state in inner.state.values() for value in state.values()]
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition"):
        tensors.extend(t for t in getattr(zero or engine.optimizer, name, []) or [] if isinstance(t, torch.Tensor))
    return unique_storage_bytes(tensors)
