"""--checkpoint-in-cpu with zero-lab's checkpoint: each recomputed layer's input waits in host memory.

Under full recomputation a layer keeps only its input until its backward; ALST (Arctic Long Sequence Training)
moves that input to host memory too, so the accelerator keeps about nothing per layer and the input comes back
for the layer's recompute. torch's non-reentrant checkpoint saves the layer's inputs through the saved-tensor
hooks around it (and everything inside the layer through its own), so `offload_to_host` around the checkpoint
call moves exactly those inputs, as torch.autograd.graph.save_on_cpu would, into the host tier below.

The host tier is `HostTensor`, which the memory measurement (megatron/accounting/measure/memory.py) counts as
host memory, never as the accelerator's. On CUDA it is pinned host memory and both copies are non_blocking on
the current stream (ordered with the layer's kernels). On CPU ranks the accelerator and the host are the same
memory: the host tier is an emulation, a copy into a tensor of its own type that the measurement files under
host memory; it frees the layer input's original and costs a memory copy each way, as on CUDA.
"""
from __future__ import annotations

import torch


class HostTensor(torch.Tensor):
    """A tensor of the host tier. Torch functions on it give plain tensors (no subclass propagation)."""

    __torch_function__ = torch._C._disabled_torch_function_impl


def to_host(tensor: torch.Tensor) -> HostTensor:
    """A copy of `tensor` in the host tier: pinned host memory from a CUDA tensor (copied non_blocking)."""
    pinned = tensor.device.type == "cuda"
    host = torch.empty(tensor.shape, dtype=tensor.dtype, layout=tensor.layout, pin_memory=pinned)
    host.copy_(tensor, non_blocking=pinned)
    # as nn.Parameter is made: as_subclass would make a view that keeps `host` alive as its base, a second tensor
    return torch.Tensor._make_subclass(HostTensor, host)


class offload_to_host(torch.autograd.graph.saved_tensors_hooks):
    """The tensors autograd saves inside move to the host tier and come back to their device when the backward
    reads them. For the checkpoint call only: torch's checkpoint saves its inputs here, and the layer's own
    saved tensors go through the checkpoint's inner hooks, which are not these."""

    def __init__(self):
        def pack(tensor: torch.Tensor):
            if tensor.numel() == 0:  # the checkpoint's empty marker tensor
                return tensor
            return tensor.device, to_host(tensor)

        def unpack(packed):
            if isinstance(packed, torch.Tensor):
                return packed
            device, host = packed
            back = torch.empty(host.shape, dtype=host.dtype, device=device)
            back.copy_(host, non_blocking=device.type == "cuda")
            return back

        super().__init__(pack, unpack)
