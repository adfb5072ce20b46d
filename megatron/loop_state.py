"""What the training loop carries from step to step: its schedule (resolved from the flags), its state, and one
step's result. The loop (megatron/training.py), the pipeline's step (megatron/pipeline_training.py) and the in-run
report (megatron/accounting/report.py) share them."""
import math
import time
from dataclasses import dataclass, field

import torch

from megatron.arguments import Args
from megatron.batch_rampup import BatchRamp


@dataclass(frozen=True)
class Schedule:
    train_iters: int
    iters_per_epoch: int
    samples_per_epoch: int
    global_batch_size: int
    train_tokens: int | None = None  # --train-tokens: also stop once this many are consumed
    ramp: BatchRamp | None = None  # --rampup-batch-size; None: every step is --global-batch-size

    def batch_at(self, consumed_samples: int) -> int:
        return self.global_batch_size if self.ramp is None else self.ramp.batch_at(consumed_samples)

    def finished(self, state: "LoopState") -> bool:
        """Megatron-DeepSpeed's stop rule: the iterations, or the tokens, reached."""
        return state.iteration >= self.train_iters or (self.train_tokens is not None and
                                                       state.consumed_tokens >= self.train_tokens)


@dataclass
class StepResult:
    # the step's mean loss over its micro-batches: a tensor still on the device, averaged over the
    # data-parallel ranks only when the loop reads it (at logging: no host sync per step), or a
    # float a step function already read (the pipeline engine's)
    loss: torch.Tensor | float
    skipped: bool
    nan: bool  # known without reading the loss (a skipped step outside fp16); a non-finite loss is added when read
    grad_norm: float | None
    # probed steps only: the most gradient bytes held after a backward, and the activations one
    # micro-batch's forward kept for its backward (None: not measured)
    grad_bytes: int = 0
    activation_bytes: int | None = None
    # and what that forward moved to --checkpoint-in-cpu's host tier (the offloaded layer inputs)
    offloaded_activation_bytes: int = 0
    # on CPU ranks, the peak that micro-batch's forward and backward held beyond the model states (None: not measured)
    step_peak_bytes: int | None = None


@dataclass
class LoopState:
    iteration: int = 0
    consumed_samples: int = 0
    consumed_tokens: int = 0  # a curriculum's steps are shorter than --seq-length
    batch_size: int = 0  # the global batch of the last step (--rampup-batch-size changes it)
    skipped_iterations: int = 0
    nan_iterations: int = 0
    nan_in_a_row: int = 0
    last_saved_iteration: int | None = None
    pending_losses: list = field(default_factory=list)  # (loss, nan) of the steps since the losses were last read
    interval_losses: list = field(default_factory=list)
    interval_seconds: float = 0.0
    interval_iterations: int = 0
    interval_seq_lengths: list = field(default_factory=list)  # each step's sequence length
    interval_samples: int = 0
    interval_tokens: int = 0
    # this launch's training steps and the seconds they took (the step clock's): seconds per iteration for
    # the checkpoint-interval advice
    launch_seconds: float = 0.0
    launch_iterations: int = 0
    interval_advised: bool = False
    epoch_losses: list = field(default_factory=list)
    epoch_start: float = field(default_factory=time.time)


def resolve_schedule(args: Args, samples_per_epoch: int) -> Schedule:
    """Turn --train-iters / --train-samples / --train-epochs into iterations (with --rampup-batch-size, Megatron's
    count: the ramp's steps, then whole global batches)."""
    t = args.training
    batch = t.global_batch_size
    iters_per_epoch = max(1, samples_per_epoch // batch)
    ramp = None
    if t.rampup_batch_size is not None:
        ramp = BatchRamp.from_flag(t.rampup_batch_size, batch, t.micro_batch_size, args.parallel.data_parallel_size)
    if t.train_iters is not None:
        iters = t.train_iters
    elif ramp is not None:
        iters = ramp.train_iters(t.train_samples)
    elif t.train_samples is not None:
        iters = math.ceil(t.train_samples / batch)
    else:
        iters = max(1, round(t.train_epochs * iters_per_epoch))
    return Schedule(train_iters=iters, iters_per_epoch=iters_per_epoch, samples_per_epoch=samples_per_epoch,
                    train_tokens=t.train_tokens, ramp=ramp, global_batch_size=batch)
