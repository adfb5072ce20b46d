"""Whether a run fits a GPU's memory, and the largest micro-batch that does: the memory model (memory.py) on the
run's busiest pipeline stage, against the GPU's memory less a headroom. tools/zero_plan.py says which ZeRO stage
fits with it; the examples_zero drivers choose their micro-batch on a GPU with it (docs/gpu.md)."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from megatron.accounting.predict.memory import memory_per_rank
from megatron.accounting.predict.training_setup import AccountingError, TrainingSetup
from megatron.model.config import GPTConfig

GIB = float(2**30)
# the fraction of a GPU's memory kept for what the memory model leaves out: the CUDA context, DeepSpeed's
# communication buckets, the allocator's fragmentation (tools/zero_plan.py's --headroom default)
HEADROOM = 0.1
# the largest micro-batch the drivers' plan tries without GLOBAL_BATCH
MOST_MICRO_BATCH = 1024


def stage_config(config: GPTConfig, pp: int) -> GPTConfig:
    """The model as its busiest pipeline stage sees it. Megatron-DeepSpeed's PipelineModule (partition method
    type:transformer) balances the layers: with L layers over p stages, L mod p stages hold ceil(L/p) and the
    rest floor(L/p) (BLOOM's 70 over 12: ten stages of 6, two of 5). The slowest stage sets the step, so memory,
    traffic and time are those of a model with ceil(L/p) layers on every stage; FLOPs and parameters stay the
    model's own."""
    return replace(config, num_layers=math.ceil(config.num_layers / pp) * pp)


def peak_memory(config: GPTConfig, setup: TrainingSetup) -> dict[str, int]:
    """memory_per_rank of the pipeline stage that needs the most (every stage with the busiest one's layers)."""
    busiest = stage_config(config, setup.pipeline_parallel_size)
    return max((memory_per_rank(busiest, setup, stage) for stage in range(setup.pipeline_parallel_size)),
               key=lambda memory: memory["total"])


def usable_bytes(device_bytes: float, headroom: float = HEADROOM) -> float:
    return device_bytes * (1.0 - headroom)


@dataclass(frozen=True)
class MicroBatchPlan:
    """The micro-batch a run on GPUs of `device_bytes` takes, its gradient accumulation and predicted peak."""
    micro_batch: int
    accumulation: int
    predicted_bytes: int
    device_bytes: int
    headroom: float
    fits: bool  # False: even micro-batch 1 is predicted over the usable memory

    def line(self) -> str:
        """What the launch says about it, in one line."""
        predicted = f"predicted {self.predicted_bytes / GIB:.1f} of {self.device_bytes / GIB:.1f} GiB per GPU"
        if not self.fits:
            return (f"micro-batch 1 from the memory plan, which predicts even that over the GPU's memory less "
                    f"{self.headroom:.0%} ({predicted}); set MICRO_BATCH, or use a higher ZeRO stage or offload")
        return (f"micro-batch {self.micro_batch} from the memory plan ({predicted}: the largest that leaves "
                f"{self.headroom:.0%} free); MICRO_BATCH sets it")


def largest_micro_batch(config: GPTConfig, setup: TrainingSetup, device_bytes: int, global_batch: int | None = None,
                        headroom: float = HEADROOM, most: int = MOST_MICRO_BATCH) -> MicroBatchPlan:
    """The largest micro-batch whose predicted peak (peak_memory) fits `device_bytes` less `headroom`. With
    `global_batch` only the micro-batches it divides into (global = micro x accumulation x data-parallel size,
    the accumulation following); without, up to `most` at setup's accumulation. `setup`'s own micro-batch is
    not read."""
    dp = setup.data_parallel_size
    if global_batch is not None and (global_batch < 1 or global_batch % dp):
        raise AccountingError(f"--global-batch-size {global_batch} is not divisible by the data-parallel size {dp}")
    per_rank = global_batch // dp if global_batch is not None else None
    candidates = ([m for m in range(1, per_rank + 1) if per_rank % m == 0] if per_rank is not None
                  else range(1, most + 1))
    limit = usable_bytes(device_bytes, headroom)
    best = None
    for micro in candidates:
        accumulation = per_rank // micro if per_rank is not None else setup.gradient_accumulation_steps
        predicted = peak_memory(config, replace(setup, micro_batch_size=micro,
                                                gradient_accumulation_steps=accumulation))["total"]
        if best is None or predicted <= limit:
            best = MicroBatchPlan(micro, accumulation, predicted, device_bytes, headroom, predicted <= limit)
        elif per_rank is None:
            break  # at a fixed accumulation the peak only grows with the micro-batch
    return best
