"""Large scratch tensors kept from one training step to the next, on CPU.

On CUDA the caching allocator hands a freed block straight back to the next request. On CPU
glibc returns blocks above its mmap threshold to the kernel, so every fresh [tokens, vocab]
tensor (200 MB for 1,024 tokens of GPT-2's vocabulary) is page-faulted and zeroed again: about
80 ms a step on one core, a quarter of the output layer's matrix product.

Under torch.compile (--compile) the buffers are plain torch.empty: the compiled graph plans its own
memory, and a Python dict mutated inside the loss's autograd.Function is a graph break (tests/test_compile.py).
"""
from __future__ import annotations

import torch


class ScratchBuffers:
    """At most one free tensor per (shape, dtype) on CPU; elsewhere a plain torch.empty."""

    def __init__(self):
        self._free: dict[tuple, torch.Tensor] = {}

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if device.type != "cpu" or torch.compiler.is_compiling():
            return torch.empty(shape, dtype=dtype, device=device)
        kept = self._free.pop((tuple(shape), dtype), None)
        return kept if kept is not None else torch.empty(shape, dtype=dtype, device=device)

    def give_back(self, tensor: torch.Tensor) -> None:
        """The caller must not use `tensor` afterwards: the next take() of its shape returns it."""
        if tensor.device.type == "cpu" and not torch.compiler.is_compiling():
            self._free[(tuple(tensor.shape), tensor.dtype)] = tensor
