"""Process start-up: launcher environment, the torch.distributed group, seeds."""
import os
import random
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"


def launcher_world_size() -> int:
    """World size as the launcher describes it, before torch.distributed exists (for parse_args)."""
    from megatron.dist_env import export_launcher_env
    export_launcher_env()
    return int(os.environ.get("WORLD_SIZE", "1"))


def initialize_distributed() -> DistInfo:
    """Fill RANK/WORLD_SIZE/... from whichever launcher ran us (torchrun, deepspeed, mpiexec),
    then let DeepSpeed create the default group: nccl on CUDA, gloo on the CPU accelerator."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from megatron.dist_env import export_launcher_env

    export_launcher_env()
    accelerator = get_accelerator()
    backend = "nccl" if accelerator.device_name() == "cuda" else "gloo"
    deepspeed.init_distributed(dist_backend=backend, verbose=False)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if accelerator.device_name() == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    return DistInfo(rank=torch.distributed.get_rank(), local_rank=local_rank,
                    world_size=torch.distributed.get_world_size(), device=device)


def set_seed(seed: int) -> None:
    """Same seed on every rank: data-parallel replicas start identical (DeepSpeed also broadcasts)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
