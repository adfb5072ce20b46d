"""`--rampup-batch-size <start> <increment> <ramp samples>`: Megatron's batch-size ramp (megatron/microbatches.py's
RampupBatchsizeNumMicroBatches and training.py's update_train_iters).

The global batch starts at <start> and grows by <increment> each time another (ramp samples / increments) samples
are consumed, where increments = (--global-batch-size - start) / increment; past <ramp samples> it is
--global-batch-size. Each batch keeps --micro-batch-size and the data-parallel size: the gradient accumulation
steps follow it. The training loop asks `batch_at(consumed samples)` before every step and hands the answer to
DeepSpeed's engine (set_train_batch_size), as Megatron-DeepSpeed does.
"""
from dataclasses import dataclass

from megatron.errors import ZeroLabError


class BatchRampError(ZeroLabError, ValueError):
    """--rampup-batch-size does not fit the batch sizes; the message names the flag."""


@dataclass(frozen=True)
class BatchRamp:
    start: int
    increment: int
    samples: int
    final: int  # --global-batch-size

    @classmethod
    def from_flag(cls, values: list[int], global_batch: int, micro_batch: int, data_parallel: int) -> "BatchRamp":
        """Megatron's checks, in one line each naming the flag; every batch the ramp reaches must split into
        micro-batches on each data-parallel rank (Megatron asserts it when the batch is reached)."""
        start, increment, samples = values
        flag = f"--rampup-batch-size {start} {increment} {samples}"
        if min(start, increment, samples) < 1:  # Megatron allows 0 ramp-up samples, then divides by them
            raise BatchRampError(f"{flag}: the start batch, the increment and the ramp-up samples must be >= 1")
        if start > global_batch or (global_batch - start) % increment:
            raise BatchRampError(f"{flag}: --global-batch-size {global_batch} must be the start batch plus a whole "
                                 "number of increments")
        ramp = cls(start, increment, samples, global_batch)
        unit = micro_batch * data_parallel
        for batch in sorted(set(ramp.batches())):
            if batch % unit:
                raise BatchRampError(f"{flag}: the ramp's global batch {batch} is not divisible by --micro-batch-size "
                                     f"{micro_batch} x data-parallel size {data_parallel}")
        return ramp

    def batch_at(self, consumed_samples: int) -> int:
        """The global batch of the step that starts after consumed_samples."""
        increments = (self.final - self.start) // self.increment
        if consumed_samples > self.samples or increments == 0:
            return self.final
        steps = int(consumed_samples / (self.samples / increments))
        return self.start + steps * self.increment

    def batches(self) -> list[int]:
        """The global batch of each step of the ramp (while the consumed samples are within it)."""
        sizes, consumed = [], 0
        while consumed <= self.samples:
            sizes.append(self.batch_at(consumed))
            consumed += sizes[-1]
        return sizes

    def train_iters(self, train_samples: int) -> int:
        """Megatron's update_train_iters: the ramp's steps, then whole batches of --global-batch-size (a partial
        last batch is dropped)."""
        ramp = self.batches()
        return len(ramp) + (train_samples - sum(ramp)) // self.final
