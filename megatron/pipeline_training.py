"""Pipeline-parallel steps: the GPT as a DeepSpeed PipelineModule, driven by engine.train_batch.

DeepSpeed's pipeline engine runs the micro-batches of one global batch through the stages
itself (its 1F1B schedule), so one step is one train_batch call over an iterator that turns
our data-loader batches into the pipeline's ((tokens, position_ids), (labels, loss_mask)).
Only the first and last stages read it. These functions have train_step's and evaluate's
signatures so that training.train runs either.
"""
import contextlib
import math

import torch

from megatron.accounting.measure import memory
from megatron.arguments import Args
from megatron.initialize import DistInfo
from megatron.loop_state import StepResult
from megatron.training import get_batch


class PipelineBatches:
    """Our {"text": [micro_batch, seq + 1]} batches in the pipeline engine's input form."""

    def __init__(self, source, device: torch.device, eod: int, eod_mask_loss: bool):
        self.source, self.device, self.eod, self.eod_mask_loss = source, device, eod, eod_mask_loss

    def __iter__(self):
        return self

    def __next__(self):
        tokens, labels, position_ids, loss_mask = get_batch(next(self.source), self.device, self.eod,
                                                            self.eod_mask_loss)
        return (tokens, position_ids), (labels, loss_mask)


class GradientProbe:
    """Inside: the optimizer's step first measures the gradients the rank holds (the engine runs every
    backward and the step inside train_batch, so this is the one moment they are all there)."""

    def __init__(self, optimizer, engine):
        self.optimizer, self.engine, self.grad_bytes = optimizer, engine, 0

    def __enter__(self):
        step = self.optimizer.step

        def measured_step(*args, **kwargs):
            self.grad_bytes = memory.grad_bytes(self.engine)
            return step(*args, **kwargs)
        self.optimizer.step = measured_step  # an instance attribute over the class's method
        return self

    def __exit__(self, *exc):
        del self.optimizer.step


def pipeline_train_step(engine, data_iterator, args: Args, dist_info: DistInfo, eod: int,
                        probe_memory=False) -> StepResult:
    """One optimizer step over the global batch; the engine pulls gradient_accumulation_steps
    micro-batches. Its loss is already averaged over micro-batches and data-parallel ranks and
    broadcast to every stage."""
    batches = PipelineBatches(data_iterator, dist_info.device, eod, args.training.eod_mask_loss)
    probe = GradientProbe(engine.optimizer, engine) if probe_memory else contextlib.nullcontext()
    with probe:
        loss = float(engine.train_batch(data_iter=batches))
    skipped = not engine.was_step_applied()
    nan = not math.isfinite(loss) or (skipped and args.deepspeed.precision != "fp16")
    # the activations are not measured: the engine runs the micro-batches' forwards inside train_batch
    grad_bytes = probe.grad_bytes if probe_memory else 0
    return StepResult(loss=loss, skipped=skipped, nan=nan, grad_norm=engine.get_global_grad_norm(),
                      grad_bytes=grad_bytes)


@torch.no_grad()
def pipeline_evaluate(engine, data_iterator, args: Args, dist_info: DistInfo, eod: int) -> float:
    """Mean loss over --eval-iters global batches (eval_batch averages over micro-batches and
    data-parallel ranks)."""
    batches = PipelineBatches(data_iterator, dist_info.device, eod, args.training.eod_mask_loss)
    losses = [float(engine.eval_batch(batches)) for _ in range(args.logging.eval_iters)]
    engine.train()
    return sum(losses) / len(losses)
