"""Process start-up: launcher environment, the torch.distributed group, seeds."""
import os
import random
import warnings
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch

from megatron.core.parallel_state import ParallelState
from megatron.errors import ZeroLabError


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    parallel: ParallelState | None = None  # the process groups of the run's layout, once they are built
    address: str = ""  # this host's address on the interface its ranks use (megatron/runtime/network.py)

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"


def silence_known_warnings() -> None:
    """DeepSpeed 0.19.8's ZeRO calls torch.distributed.all_gather_into_tensor and reduce_scatter_tensor,
    which torch 2.13 deprecates (for all_gather_single / reduce_scatter_single): FutureWarnings we cannot
    act on, and ones Python re-prints at every step (each warnings.catch_warnings() block resets the
    once-per-location registry). Only those two messages are ignored; every other warning still shows."""
    warnings.filterwarnings(
        "ignore", message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
        category=FutureWarning)


def launcher_world_size() -> int:
    """World size as the launcher describes it, before torch.distributed exists (for parse_args)."""
    from megatron.runtime.dist_env import export_launcher_env
    export_launcher_env()
    return int(os.environ.get("WORLD_SIZE", "1"))


class DeviceError(ZeroLabError):
    """This rank sees no CUDA device to bind to; the message says what CUDA_VISIBLE_DEVICES held."""


def cuda_device_index(local_rank: int, device_count: int, visible: str | None = None) -> int:
    """The CUDA device this rank uses, as an index among the devices it sees.

    A launcher that shows every rank all of its host's GPUs (torchrun, mpiexec) leaves local rank i on GPU i.
    A site that gives each rank its own GPU (srun --gpus-per-task=1 or --gpu-bind, ALCF's affinity script
    setting CUDA_VISIBLE_DEVICES per rank) shows each rank one device, index 0, whatever its local rank:
    local_rank % device_count is right for both, and for k GPUs per rank too. `visible` is
    CUDA_VISIBLE_DEVICES, named in the error when this rank sees none."""
    if device_count < 1:
        shown = "unset" if visible is None else repr(visible)
        raise DeviceError(f"local rank {local_rank} sees no CUDA device (CUDA_VISIBLE_DEVICES is {shown}): "
                          "the launcher or the site's binding gave this rank no GPU")
    return local_rank % device_count


def bind_device(device_name: str, local_rank: int) -> torch.device:
    """This rank's device, made current: done before the process group exists, so that NCCL's communicator
    and the later torch.cuda calls are on this rank's GPU. (DeepSpeed's engine sets the device again, to
    LOCAL_RANK unless deepspeed.initialize gets args with device_rank: the caller passes this index.)"""
    if device_name != "cuda":
        return torch.device("cpu")
    index = cuda_device_index(local_rank, torch.cuda.device_count(), os.environ.get("CUDA_VISIBLE_DEVICES"))
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def initialize_distributed(timeout_minutes: float) -> DistInfo:
    """Fill RANK/WORLD_SIZE/... from whichever launcher ran us (torchrun, deepspeed, mpiexec, srun), pick the
    network interface that reaches the master (megatron/runtime/network.py), bind this rank's GPU
    (bind_device), then let DeepSpeed create the default group: nccl on CUDA, gloo on the CPU accelerator.
    A collective that waits longer than timeout_minutes (a lost host) raises instead of hanging.
    DeepSpeed's ops are built in the environment's own folder, each announced in one line by local rank 0
    (megatron/deepspeed_ops.py): on the CPU accelerator init_distributed loads the shared-memory op."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    from megatron import deepspeed_ops
    from megatron.deepspeed_quiet import SHM_OP_LOADED, without_lines
    from megatron.runtime import network
    from megatron.runtime.dist_env import all_ranks_on_this_host, export_launcher_env

    local_rank = export_launcher_env().local_rank
    deepspeed_ops.use_environment_extensions()
    deepspeed_ops.announce_builds(quiet=local_rank != 0)
    said, address = network.configure(os.environ, one_host=all_ranks_on_this_host())
    if local_rank == 0:
        print(said, flush=True)  # one line per host: which interface and address its ranks use
    device_name = get_accelerator().device_name()
    device = bind_device(device_name, local_rank)  # before the group: Megatron's order
    backend = "nccl" if device_name == "cuda" else "gloo"
    with without_lines(SHM_OP_LOADED):  # each rank's, built or not: a build is announced above
        deepspeed.init_distributed(dist_backend=backend, verbose=False, timeout=timedelta(minutes=timeout_minutes))
    return DistInfo(rank=torch.distributed.get_rank(), local_rank=local_rank,
                    world_size=torch.distributed.get_world_size(), device=device, address=address)


def set_seed(seed: int) -> None:
    """Same seed on every rank: data-parallel replicas start identical (DeepSpeed also broadcasts)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
