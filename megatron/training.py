"""The training loop: a step over the micro-batches, evaluation, logging, checkpoints.

DeepSpeed does ZeRO partitioning, offload, mixed precision, clipping and gradient accumulation;
this file feeds it batches, turns the loss into the masked mean, and reports.
"""
import contextlib
import math
import time
from collections import deque
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

import psutil
import torch
import torch.distributed as dist

from megatron.accounting.measure import comm_counter, memory
from megatron.arguments import Args
from megatron.batch_rampup import BatchRamp
from megatron.checkpointing import interval
from megatron.checkpointing.save_load import save_checkpoint
from megatron.curriculum import SeqlenCurriculum
from megatron.deepspeed_quiet import EXPERT_GROUP_CREATED, without_lines
from megatron.exit_signal import ExitSignalHandler, minutes_past
from megatron.errors import ZeroLabError
from megatron.accounting.measure.host_probe import TrainerSteps
from megatron.initialize import DistInfo
from megatron.runtime.dist_env import all_ranks_on_this_host
from megatron.accounting.length_predictions import LengthPredictions
from megatron.model import moe
from megatron.optimizer_states import optimizer_state_scalars
from megatron.accounting.measure.step_timing import PROBES_SKIPPED_LINE, OffloadStepClock, predict_at_startup, probes_skipped
from megatron.training_log import (IterationStats, MoEStats, TensorBoardWriter, comm_line, comm_scalars, epoch_line,
                                   exit_duration_line, iteration_line, iteration_scalars, memory_line, memory_scalars,
                                   model_state_line, parameters_line, peak_line, probe_line, progress_line,
                                   run_info_line, time_line, time_scalars, timer_scalars, validation_line,
                                   validation_scalars)


class TrainingError(ZeroLabError, RuntimeError):
    """Training cannot go on (e.g. too many NaN iterations in a row); the message says why."""


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


# --exit-signal-handler: the ranks agree on the SIGTERM flag (a collective and a host sync) every
# min(--log-interval, this) iterations, not after every step (docs/checkpoints.md)
EXIT_SIGNAL_POLL_STEPS = 10


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


def get_batch(batch: dict, device: torch.device, eod: int, eod_mask_loss: bool, sequence=None):
    """Shift the (seq_length + 1)-token samples into inputs and labels; positions 0..s-1. With `eod_mask_loss`,
    the loss leaves out each position whose input is the end-of-document id (the prediction across a document
    boundary), as Megatron-DeepSpeed's get_ltor_masks_and_position_ids does; the prediction of the id is trained.
    With `sequence`, a DeepSpeed-Ulysses group (its rank and size): this rank's slice of every sample, at its
    global positions (the group's ranks read the same samples)."""
    text = batch["text"].to(device, non_blocking=True).long()
    tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
    position_ids = torch.arange(tokens.shape[1], device=device).unsqueeze(0).expand_as(tokens)
    loss_mask = torch.ones_like(labels, dtype=torch.float32)
    if eod_mask_loss:
        loss_mask[tokens == eod] = 0.0
    if sequence is None or sequence.size == 1:
        return tokens, labels, position_ids, loss_mask
    part = tokens.shape[1] // sequence.size
    mine = slice(sequence.rank * part, (sequence.rank + 1) * part)
    return tuple(t[:, mine].contiguous() for t in (tokens, labels, position_ids, loss_mask))


def masked_mean_loss(per_token_loss: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    return (per_token_loss.float() * loss_mask).sum() / loss_mask.sum().clamp(min=1.0)


def sequence_mean_loss(per_token_loss: torch.Tensor, loss_mask: torch.Tensor, sequence) -> tuple:
    """(what this rank backpropagates, the masked mean loss over the whole sequences). Under DeepSpeed-Ulysses
    each rank of `sequence` (its group) holds a slice: it backpropagates its slice's share of the whole mean, and
    DeepSpeed sums the group's gradients (it averages over the sequence-data-parallel group times the sequence
    size), as Megatron-DeepSpeed's loss does."""
    if sequence is None or sequence.size == 1:
        loss = masked_mean_loss(per_token_loss, loss_mask)
        return loss, loss.detach()
    count = loss_mask.sum()
    dist.all_reduce(count, group=sequence.handle)
    share = (per_token_loss.float() * loss_mask).sum() / count.clamp(min=1.0)
    whole = share.detach().clone()
    dist.all_reduce(whole, group=sequence.handle)
    return share, whole


def sequence_gradient_factor(zero_stage: int, sequence) -> float:
    """What this rank's loss share is multiplied by before its backward under DeepSpeed-Ulysses. DeepSpeed's ZeRO
    0-2 reductions divide the sequence-data-parallel sum by its size / SP (they sum the sequence ranks), but
    ZeRO-3's reduce-scatter (reduce_scatter on, DeepSpeed's default; off is refused with SP) divides by its whole
    size: there the share is scaled by SP, so that every stage gets the gradient of the whole sequences' mean
    (SP=2 at ZeRO-3 otherwise logs half the grad norm of SP=1 and drifts from its losses by 1e-4)."""
    return float(sequence.size) if zero_stage == 3 and sequence is not None else 1.0


def with_moe_loss(loss: torch.Tensor, module: torch.nn.Module, coeff: float) -> torch.Tensor:
    """The lm loss plus --moe-loss-coeff x the MoE layers' load-balancing losses of the forward just run, as
    Megatron-DeepSpeed's loss function adds them (the lm loss alone is what the log calls lm loss)."""
    aux = moe.aux_loss(module)
    return loss if aux is None else loss + coeff * aux


def data_parallel_mean(value: torch.Tensor, dist_info: DistInfo) -> float:
    """Mean over the data-parallel replicas (the tensor-parallel ranks of one replica hold the same value)."""
    return data_parallel_means([value], dist_info)[0]


def data_parallel_means(values: list, dist_info: DistInfo) -> list[float]:
    """data_parallel_mean of each tensor (floats are taken as already averaged), in one collective and one
    host sync for all of them."""
    group = dist_info.parallel.data
    tensors = [i for i, value in enumerate(values) if isinstance(value, torch.Tensor)]
    means = [float(value) if i not in tensors else 0.0 for i, value in enumerate(values)]
    if tensors:
        reduced = torch.stack([values[i].detach().float().reshape(()) for i in tensors])
        dist.all_reduce(reduced, group=group.handle)
        for i, total in zip(tensors, reduced.tolist()):
            means[i] = total / group.size
    return means


def train_step(engine, data_iterator, args: Args, dist_info: DistInfo, eod: int, probe_memory=False) -> StepResult:
    """One optimizer step over gradient_accumulation_steps micro-batches. probe_memory: also measure the
    gradients held after each backward (their peak) and the first micro-batch's activations."""
    losses = []
    grad_bytes, activations = 0, None
    # the engine's count: --rampup-batch-size changes it between steps
    accumulation = engine.gradient_accumulation_steps()
    for micro in range(accumulation):
        # DeepSpeed's own boundary counts micro-batches since the run began: after a change of the
        # accumulation steps it would fall in the middle of a step
        engine.set_gradient_accumulation_boundary(micro == accumulation - 1)
        tokens, labels, position_ids, loss_mask = get_batch(next(data_iterator), dist_info.device, eod,
                                                            args.training.eod_mask_loss, dist_info.parallel.sequence)
        measure = probe_memory and micro == 0
        with memory.saved_activation_bytes(engine.module) if measure else contextlib.nullcontext() as saved:
            per_token_loss = engine(tokens, position_ids, labels)
        if measure:
            activations = saved[0]
        loss, whole = sequence_mean_loss(per_token_loss, loss_mask, dist_info.parallel.sequence)
        loss = with_moe_loss(loss, engine.module, args.training.moe_loss_coeff)
        engine.backward(loss * sequence_gradient_factor(args.deepspeed.zero_stage, dist_info.parallel.sequence))
        losses.append(whole)
        if probe_memory:
            grad_bytes = max(grad_bytes, memory.grad_bytes(engine))
        engine.step()
    skipped = not engine.was_step_applied()
    # fp16 overflow skips are loss-scale housekeeping; anywhere else a skipped step means inf/nan grads
    nan = skipped and args.deepspeed.precision != "fp16"
    return StepResult(loss=torch.stack(losses).mean(), skipped=skipped, nan=nan, grad_norm=engine.get_global_grad_norm(),
                      grad_bytes=grad_bytes, activation_bytes=activations)


@torch.no_grad()
def evaluate(engine, data_iterator, args: Args, dist_info: DistInfo, eod: int) -> float:
    engine.eval()
    losses = []
    for _ in range(args.logging.eval_iters * engine.gradient_accumulation_steps()):  # a batch ramp's current
        tokens, labels, position_ids, loss_mask = get_batch(next(data_iterator), dist_info.device, eod,
                                                            args.training.eod_mask_loss, dist_info.parallel.sequence)
        losses.append(sequence_mean_loss(engine(tokens, position_ids, labels), loss_mask,
                                         dist_info.parallel.sequence)[1])
    engine.train()
    return data_parallel_mean(torch.stack(losses).mean(), dist_info)


# the progress line's ETA: the wall-clock rate over this many of the last logging intervals
PROGRESS_WINDOW = 10


@dataclass
class ProgressClock:
    """The progress line's clock (docs/log-lines.md): elapsed since the printing rank's process started (this
    launch, start-up included), and the wall-clock seconds per iteration between the last PROGRESS_WINDOW + 1
    progress lines: the loop's own logging, evaluation and saving included, so that the ETA holds for the whole
    loop. A launch's first interval has no line before it to time from (and holds the warm-up): no ETA yet."""
    launch_started: float = field(default_factory=lambda: psutil.Process().create_time())
    marks: deque = field(default_factory=lambda: deque(maxlen=PROGRESS_WINDOW + 1))  # (iteration, time.time())

    def line(self, rank: int, iteration: int, train_iters: int) -> str:
        now = time.time()
        self.marks.append((iteration, now))
        (first, started), rate = self.marks[0], None
        if iteration > first:
            rate = ((now - started) / (iteration - first), first + 1)
        return progress_line(rank, iteration, train_iters, now - self.launch_started, rate)


@dataclass
class Reporter:
    """Everything the loop prints or records: built once, used by the loop."""
    args: Args
    dist_info: DistInfo
    schedule: Schedule
    # FLOPs, memory, traffic and step time predicted at a sequence length (a curriculum's changes)
    predictions: LengthPredictions
    peak_tflops: float | None
    tracker: memory.MemoryTracker
    # each interval's scalars go to these, on the rank that prints: TensorBoardWriter, wandb_writer.WandbWriter
    writers: list = field(default_factory=list)
    log_rank: int = 0  # the rank that prints: tensor rank 0, data-parallel rank 0 of the last pipeline stage
    # bytes sent through collectives during training steps (docs/zero-tradeoff.md); None: not counted
    comm: comm_counter.CommCounter | None = None
    num_params: int = 1
    comm_before: dict = field(default_factory=dict)
    offload_clock: OffloadStepClock | None = None  # the offloaded optimizer step's seconds; None: no offload
    blocked_before: float = 0.0
    offload_before: float = 0.0
    progress: ProgressClock = field(default_factory=ProgressClock)

    def print_line(self, line: str):
        if self.dist_info.rank == self.log_rank:
            print(line, flush=True)

    def iteration(self, state: LoopState, engine):
        args, world = self.args, self.dist_info.world_size
        seconds = state.interval_seconds / max(1, state.interval_iterations)
        batch, lengths = state.batch_size, state.interval_seq_lengths or [args.model.seq_length]
        interval = max(1, state.interval_iterations)
        predicted = self.predictions.over(lengths)
        finite = [loss for loss in state.interval_losses if math.isfinite(loss)]
        # the predictions are for --global-batch-size: a batch ramp's steps are smaller
        tflops = (predicted.model_flops * state.interval_samples / interval / args.training.global_batch_size
                  / seconds / world / 1e12)
        grad_norm = engine.get_global_grad_norm()
        stats = IterationStats(
            iteration=state.iteration, train_iters=self.schedule.train_iters,
            consumed_samples=state.consumed_samples, consumed_tokens=state.consumed_tokens,
            elapsed_ms=seconds * 1000.0, learning_rate=engine.get_lr()[0], global_batch_size=batch,
            lm_loss=sum(finite) / len(finite) if finite else float("nan"),
            loss_scale=float(getattr(engine.optimizer, "loss_scale", 1.0)),
            grad_norm=None if grad_norm is None else float(grad_norm),
            skipped_iterations=state.skipped_iterations, nan_iterations=state.nan_iterations,
            samples_per_second=state.interval_samples / interval / seconds,
            tokens_per_gpu_per_second=state.interval_tokens / interval / seconds / world, tflops=tflops,
            curriculum_seqlen=lengths[-1] if args.curriculum is not None else None, moe=self.moe_stats(engine))
        self.print_line(iteration_line(stats))
        mfu = hfu = None
        if self.peak_tflops is not None:
            mfu = 100.0 * tflops / self.peak_tflops
            hfu = mfu * predicted.hardware_flops / predicted.model_flops
        device, mem = "cuda" if self.dist_info.on_cuda else "cpu", self.tracker.sample()
        self.print_line(memory_line(self.dist_info.rank, device, state.iteration, mem, mfu, hfu))
        scalars = iteration_scalars(stats) | memory_scalars(mem, mfu, hfu)
        if self.comm is not None:
            now = self.comm.snapshot()
            sent = comm_counter.since(now, self.comm_before, state.interval_iterations)
            self.comm_before = now
            traffic = self.moe_traffic(engine, predicted.traffic, lengths, state.interval_iterations)
            self.print_line(comm_line(self.dist_info.rank, state.iteration, sent, self.num_params, traffic))
            scalars |= comm_scalars(sent, self.num_params, traffic)
        log = args.logging
        if predicted.time is not None or log.log_timers_to_tensorboard:
            measured = self.measured_time(seconds, state.interval_iterations)
            if predicted.time is not None:
                self.print_line(time_line(self.dist_info.rank, state.iteration, measured, predicted.time))
                scalars |= time_scalars(measured, predicted.time)
            if log.log_timers_to_tensorboard:
                scalars |= timer_scalars(measured)
        if log.log_batch_size_to_tensorboard:
            scalars["batch-size/batch-size"] = batch
        if log.log_optimizer_states_to_tensorboard:  # collectives: every rank
            scalars |= optimizer_state_scalars(engine, self.dist_info.parallel, self.dist_info.device)
        self.print_line(self.progress.line(self.dist_info.rank, state.iteration, self.schedule.train_iters))
        for writer in self.writers:
            writer.scalars(scalars, state.iteration)

    def moe_stats(self, engine) -> MoEStats | None:
        """The interval's routing summed over the data-parallel ranks (one collective), and its counts restarted."""
        layers = moe.moe_layers(engine.module)
        if not layers:
            return None
        flat = [layer.stats.take() for layer in layers]
        summed = torch.cat(flat)
        data = self.dist_info.parallel.data
        dist.all_reduce(summed, group=data.handle)
        per_layer = list(summed.split([len(f) for f in flat]))
        return MoEStats(*moe.routing_summary(per_layer, self.args.training.moe_loss_coeff))

    def moe_traffic(self, engine, predicted: float, lengths: list[int], interval_iterations: int) -> float:
        """The predicted traffic with, without token dropping, the MoE all-to-alls sized by the capacities this
        rank's gates chose in the interval (the most loaded expert's tokens, known only once routed), not by the
        balanced gate's that the prediction assumes (accounting.moe_capacity)."""
        from megatron import accounting

        config, setup = self.args.model, self.predictions.setup
        layers = moe.moe_layers(engine.module)
        if not layers:
            return predicted
        capacities = [layer.stats.take_capacity() / max(1, interval_iterations) for layer in layers]
        if config.moe_token_dropping or len(set(lengths)) > 1:
            return predicted
        assumed = accounting.moe_all_to_all_per_step(replace(config, seq_length=lengths[0]), setup)
        routed = accounting.moe_all_to_all_per_step(replace(config, seq_length=lengths[0]), setup, capacities)
        return predicted - sum(assumed.values()) + sum(routed.values())

    def measured_time(self, step_seconds: float, interval_iterations: int) -> dict[str, float]:
        """The interval's mean step time split into compute, communication (blocked in collectives) and
        offload (the offloaded optimizer's step), per iteration; reading the parts starts the next interval."""
        iterations = max(1, interval_iterations)
        blocked = sum(self.comm.seconds().values()) if self.comm is not None else 0.0
        offload = self.offload_clock.seconds if self.offload_clock is not None else 0.0
        communication = (blocked - self.blocked_before) / iterations
        offloaded = (offload - self.offload_before) / iterations
        self.blocked_before, self.offload_before = blocked, offload
        return dict(compute=max(0.0, step_seconds - communication - offloaded), communication=communication,
                    offload=offloaded, total=step_seconds)

    def model_state(self, engine, probed: StepResult, seq_length: int):
        """The first step's model states and activations (at its sequence length) beside the estimate."""
        mem = self.tracker.sample(end_interval=False)  # mid-interval: the next memory line keeps this peak
        ds = self.args.deepspeed
        params, optim = memory.param_bytes(engine), memory.optimizer_bytes(engine)
        host_grads = memory.host_gradient_bytes(engine)
        held = params + optim + memory.grad_bytes(engine) + host_grads
        # Offloaded states are the ones DeepSpeed keeps in host memory, or in this rank's files for NVMe: on
        # CPU ranks host memory is the accelerator's, so they are told apart by where DeepSpeed puts them.
        # Stage 3's gradient accumulation buffer stays in host memory with either offload device.
        if ds.nvme_path is not None:
            offloaded = memory.swap_file_bytes(ds.nvme_path, self.dist_info.rank) + host_grads
        else:
            offloaded = (optim if ds.offload_optimizer else 0) + (params if ds.offload_params else 0) + host_grads
        measured = {"params": 0 if ds.offload_params else params, "grads": probed.grad_bytes,
                    "optim": 0 if ds.offload_optimizer else optim, "offloaded": offloaded}
        if probed.activation_bytes is not None:
            measured["activations"] = probed.activation_bytes
        # what else is allocated (the output-layer buffer, bucket and communication buffers); the CUDA
        # counter does not see host memory, so there the offloaded states are not subtracted
        measured["other"] = max(0, mem["allocated"] - (held - offloaded if self.dist_info.on_cuda else held))
        # ZeRO partitions over data- x DeepSpeed-Ulysses sequence-parallel ranks (as the estimate does)
        partitions = self.predictions.setup.zero_partitions
        estimate = self.predictions.at(seq_length).memory
        self.print_line(model_state_line(measured, estimate, ds.zero_stage, partitions,
                                         ds.precision, ds.offload))

    def counting(self):
        """Count the collectives of what runs inside (a training step), when a counter is installed."""
        return self.comm.counting() if self.comm is not None else contextlib.nullcontext()

    def close(self):
        for writer in self.writers:
            writer.close()

    def validation(self, iteration: int, loss: float):
        self.print_line(validation_line(iteration, loss))
        for writer in self.writers:
            writer.scalars(validation_scalars(loss, self.args.logging.log_validation_ppl_to_tensorboard), iteration)

    def epoch(self, state: LoopState):
        finite = [loss for loss in state.epoch_losses if math.isfinite(loss)]
        loss = sum(finite) / len(finite) if finite else float("nan")
        self.print_line(epoch_line(state.iteration // self.schedule.iters_per_epoch, state.iteration,
                               state.consumed_samples, time.time() - state.epoch_start, loss))


def _synchronize(dist_info: DistInfo):
    if dist_info.on_cuda:
        torch.cuda.synchronize()


class _StepClock:
    """The seconds the training steps take. It waits for the device only when started or stopped, which
    the loop does around its bookkeeping (logging, evaluation, saving, ...), so the steps in between are
    queued back to back without a host sync; the bookkeeping's own time is not counted."""

    def __init__(self, dist_info: DistInfo):
        self.dist_info, self.started = dist_info, 0.0

    def start(self) -> "_StepClock":
        _synchronize(self.dist_info)
        self.started = time.time()
        return self

    def stop(self) -> float:
        _synchronize(self.dist_info)
        return time.time() - self.started


def _record_step(state: LoopState, result: StepResult, batch: int, seq_length: int):
    """Megatron-DeepSpeed's count: the step's samples, and its tokens at its length (a curriculum's truncated one)."""
    state.iteration += 1
    state.interval_iterations += 1
    state.interval_seq_lengths.append(seq_length)
    state.batch_size = batch
    state.consumed_samples += batch
    state.consumed_tokens += batch * seq_length
    state.interval_samples += batch
    state.interval_tokens += batch * seq_length
    state.skipped_iterations += int(result.skipped)
    state.pending_losses.append((result.loss, result.nan))


def _read_losses(state: LoopState, args: Args, dist_info: DistInfo):
    """Read the losses of the steps since the last read (one collective, one host sync) and count their NaN
    iterations in order: --max-nan-iterations stops the run naming the iteration that reached it."""
    if not state.pending_losses:
        return
    first = state.iteration - len(state.pending_losses) + 1
    values = data_parallel_means([loss for loss, _ in state.pending_losses], dist_info)
    flags = [nan for _, nan in state.pending_losses]
    state.pending_losses = []
    for iteration, loss, nan in zip(range(first, state.iteration + 1), values, flags):
        nan = nan or not math.isfinite(loss)
        state.nan_iterations += int(nan)
        state.nan_in_a_row = state.nan_in_a_row + 1 if nan else 0
        state.interval_losses.append(loss)
        state.epoch_losses.append(loss)
        if state.nan_in_a_row >= args.training.max_nan_iterations:
            raise TrainingError(f"stopping at iteration {iteration}: {state.nan_in_a_row} iterations in a row "
                                f"had a non-finite loss or gradient (--max-nan-iterations "
                                f"{args.training.max_nan_iterations})")


def train(engine, train_iterator, valid_iterator, args: Args, dist_info: DistInfo, reporter: Reporter,
          eod: int, state: LoopState, step_fn=train_step, evaluate_fn=evaluate) -> LoopState:
    """Run from state.iteration to the end of the schedule; returns the final state.
    step_fn/evaluate_fn: this file's, or megatron.pipeline_training's for the pipeline engine."""
    schedule, log, ckpt, exit_interval = reporter.schedule, args.logging, args.checkpoint, args.training.exit_interval
    first_step = True
    exit_signal = ExitSignalHandler() if args.training.exit_signal_handler else None
    poll_every = min(log.log_interval, EXIT_SIGNAL_POLL_STEPS)
    curriculum = SeqlenCurriculum(args.curriculum) if args.curriculum is not None else None
    if curriculum is not None:
        train_iterator = curriculum.truncating(train_iterator)
    clock, clock_from = _StepClock(dist_info).start(), state.iteration
    if state.iteration > 0 and schedule.finished(state):  # resumed past the end: else the run would end saying nothing
        reporter.print_line(f"nothing to train: the checkpoint resumed is at iteration {state.iteration}, already "
                            f"at or past the {_asked_for(schedule, state)}, or "
                            "start afresh with FRESH=1 or under another RUN_NAME (pretrain_gpt.py alone: another "
                            "--load folder)")
    while not schedule.finished(state):
        # the global step about to run, as Megatron-DeepSpeed asks its scheduler: a resume continues the schedule
        seq_length = curriculum.update(state.iteration + 1) if curriculum is not None else args.model.seq_length
        batch = _announce_step(engine, schedule, state, args)
        with reporter.counting():
            result = step_fn(engine, train_iterator, args, dist_info, eod, probe_memory=first_step)
        _record_step(state, result, batch, seq_length)
        it = state.iteration
        logging = it % log.log_interval == 0 or schedule.finished(state)
        evaluating = valid_iterator is not None and log.eval_iters > 0 and it % log.eval_interval == 0
        epoch_end = it % schedule.iters_per_epoch == 0
        saving = bool(ckpt.save and ckpt.save_interval and it % ckpt.save_interval == 0)
        polling = exit_signal is not None and it % poll_every == 0
        timed = args.training.exit_duration_in_mins is not None  # asked after every step, as Megatron does
        if not (first_step or logging or evaluating or epoch_end or saving or polling or timed or
                (exit_interval and it % exit_interval == 0)):
            continue  # nothing to read: the next step is queued without waiting for this one
        seconds = clock.stop()
        state.interval_seconds += seconds
        state.launch_seconds += seconds
        state.launch_iterations += it - clock_from
        _read_losses(state, args, dist_info)
        if first_step:
            reporter.model_state(engine, result, seq_length)
            first_step = False
        if logging:
            reporter.iteration(state, engine)
            state.interval_losses, state.interval_seconds, state.interval_iterations = [], 0.0, 0
            state.interval_seq_lengths, state.interval_samples, state.interval_tokens = [], 0, 0
        if evaluating:
            reporter.validation(it, evaluate_fn(engine, valid_iterator, args, dist_info, eod))
        if epoch_end:
            reporter.epoch(state)
            state.epoch_losses, state.epoch_start = [], time.time()
        if saving:
            save(engine, args, state, dist_info, reporter)
        if polling and exit_signal.stop_requested(dist_info.device):
            if ckpt.save:
                save(engine, args, state, dist_info, reporter, final=f"exiting on {exit_signal.name}")
            saved = f"checkpoint saved to {ckpt.save}" if ckpt.save else "nothing saved: no --save"
            stopped = f" exiting program after receiving {exit_signal.name} at iteration {it} ({saved})"
            reporter.print_line(stopped)
            if dist_info.local_rank == 0 and not all_ranks_on_this_host() and dist_info.rank != reporter.log_rank:
                # another host's launch reads only its own ranks' output: its attempt supervisor
                # (megatron/launch/attempt.py) learns from this line that the job stopped with its checkpoint saved
                print(stopped, flush=True)
            break
        if exit_interval and it % exit_interval == 0:
            reporter.print_line(f" exiting program at iteration {it} (--exit-interval {exit_interval})")
            break
        if timed and (minutes := minutes_past(args.training.exit_duration_in_mins, reporter.progress.launch_started,
                                              dist_info.device)) is not None:
            if ckpt.save:
                save(engine, args, state, dist_info, reporter, final="exiting after --exit-duration-in-mins")
            reporter.print_line(exit_duration_line(minutes))
            break
        clock, clock_from = clock.start(), it
    return state


def _announce_step(engine, schedule: Schedule, state: LoopState, args: Args) -> int:
    """The next step's global batch, handed to DeepSpeed's engine when --rampup-batch-size changes it (its gradient
    accumulation steps follow), and to the learning-rate schedule with the tokens consumed so far."""
    batch = schedule.batch_at(state.consumed_samples)
    if batch != engine.train_batch_size():
        engine.set_train_batch_size(batch)
        # DeepSpeed divides by its own data-parallel size, which must be the layout's
        unit = args.training.micro_batch_size * args.parallel.data_parallel_size
        if engine.gradient_accumulation_steps() * unit != batch:
            raise TrainingError(f"--rampup-batch-size: DeepSpeed split the global batch {batch} into "
                                f"{engine.gradient_accumulation_steps()} micro-batches per rank, not {batch // unit}; "
                                "this layout cannot ramp the batch: train at --global-batch-size")
    engine.lr_scheduler.before_step(batch, state.consumed_tokens)
    return batch


def _asked_for(schedule: Schedule, state: LoopState) -> str:
    if state.iteration >= schedule.train_iters:
        return f"{schedule.train_iters} iterations asked for; ask for more iterations"
    return (f"{schedule.train_tokens} tokens asked for by --train-tokens ({state.consumed_tokens} consumed); ask for "
            "more tokens")


def save(engine, args: Args, state: LoopState, dist_info: DistInfo, reporter: Reporter | None = None,
         final: str | None = None) -> None:
    """Save once per iteration (the final save after the loop skips an iteration already saved). With
    --mtbf-hours, the first save of a launch that has timed steps prints the checkpoint interval that fits.
    final: the run stops after this save, for this reason; with --async-save it waits for the last write."""
    if state.last_saved_iteration != state.iteration:
        saver = save_checkpoint
        if args.checkpoint.async_save:  # the seconds returned: how long training waited
            from megatron.checkpointing.async_save import save_in_background as saver
        seconds = saver(engine, args, state.iteration, state.consumed_samples, dist_info.rank,
                        consumed_tokens=state.consumed_tokens)
        state.last_saved_iteration = state.iteration
        mtbf_hours = args.checkpoint.mtbf_hours
        if reporter is not None and mtbf_hours and not state.interval_advised and state.launch_iterations:
            advice = interval.advise(seconds, state.launch_seconds / state.launch_iterations, mtbf_hours,
                                     args.checkpoint.save_interval)
            reporter.print_line(advice.line())
            state.interval_advised = True
    if final is not None and args.checkpoint.async_save:
        from megatron.checkpointing.async_save import finish
        finish(engine, final)


def engine_device_args(dist_info: DistInfo) -> SimpleNamespace | None:
    """What deepspeed.initialize takes as `args` to use the rank's GPU: its engine sets the device again, to
    LOCAL_RANK unless args.device_rank says otherwise, which breaks sites that give each rank its own GPU
    (every rank sees index 0: megatron/initialize.py)."""
    return SimpleNamespace(device_rank=dist_info.device.index) if dist_info.on_cuda else None


def setup_engine(model_builder, num_params: int, args: Args, dist_info: DistInfo, train_iters: int,
                 deepspeed_defaults: bool = False, zero_overrides: dict | None = None):
    """Build the model (partitioned at creation under ZeRO-3), optimizer, schedule and DeepSpeed engine.
    `deepspeed_defaults` (benchmarks' "before" only) restores what issue 55 changed: megatron/deepspeed_defaults.py.
    dist_info.parallel is DeepSpeed's mpu (ZeRO partitions over the ranks holding the same parameters: data- and
    DeepSpeed-Ulysses sequence-parallel ones) except for a PipelineModule, which brings its own grid.
    `zero_overrides`: keys set in the config's zero_optimization section (megatron/accounting/measure/host_probe.py's
    skeletons'
    bucket sizes). Returns (engine, the DeepSpeed config actually used)."""
    state = dist_info.parallel
    mpu = state if args.parallel.pipeline_model_parallel_size == 1 else None
    import deepspeed

    from megatron.deepspeed_config import deepspeed_config
    from megatron.optimizer import LRSchedule, build_optimizer, import_muon_uncompiled
    from megatron.stage0_optimizer import expert_norm_unfused_optimizer
    from megatron.zero_clipping import clip_without_host_reads

    config = deepspeed_config(args, num_params, args.model.hidden_size, dist_info.on_cuda)
    if deepspeed_defaults:
        from megatron.deepspeed_defaults import restore_deepspeed_defaults
        config = restore_deepspeed_defaults(config, args.model.hidden_size, num_params, dist_info.on_cuda)
    if zero_overrides:
        config["zero_optimization"] = {**config.get("zero_optimization", {}), **zero_overrides}
    if args.model.recompute_with_deepspeed:  # before the model is built, as Megatron-DeepSpeed's initialize
        from megatron.core.tensor_parallel.random import configure_deepspeed_checkpointing
        stage_layers = args.model.num_layers // args.parallel.pipeline_model_parallel_size
        # On CPU ranks the checkpoints are in host memory already; DeepSpeed 0.19.8's CPU checkpointing would empty
        # them there (its copy to the CPU is the tensor itself), so --checkpoint-in-cpu applies on CUDA only
        configure_deepspeed_checkpointing(state, config, stage_layers,
                                          args.deepspeed.checkpoint_in_cpu and dist_info.on_cuda)
    if args.deepspeed.zero_stage == 3:
        # each rank materialises only its shard; the full model never sits on one rank
        with deepspeed.zero.Init(config_dict_or_path=config, remote_device="cpu" if args.deepspeed.offload_params
                                 else None, pin_memory=dist_info.on_cuda and args.deepspeed.offload_params, mpu=mpu,
                                 # partition (and broadcast at creation) over the ranks holding the same
                                 # parameters only, or the tensor-parallel ranks would all get rank 0's shards
                                 data_parallel_group=None if mpu is None
                                 else mpu.get_sequence_data_parallel_group()):
            model = model_builder()
    else:
        model = model_builder().to(dist_info.device)
    optimizer = build_optimizer(model, args, state)
    schedule = LRSchedule(optimizer, args.optimizer, train_iters, args.training.global_batch_size,
                          args.training.train_samples)
    import_muon_uncompiled()
    # stage 0 in 16-bit: one host read a step, a norm with the experts; each rank's line for the expert groups
    # the engine always creates is dropped
    with expert_norm_unfused_optimizer(enabled=not deepspeed_defaults), without_lines(EXPERT_GROUP_CREATED):
        engine, _, _, _ = deepspeed.initialize(args=engine_device_args(dist_info), model=model, optimizer=optimizer,
                                               lr_scheduler=schedule, config=config, mpu=mpu,
                                               dist_init_required=False)
    if not deepspeed_defaults:
        clip_without_host_reads(engine.optimizer)  # ZeRO 1-2: no host read per optimizer group (docs/gpu-reference.md)
    if args.training.compile:
        compile_engine(engine, args.deepspeed.zero_stage, pipeline=mpu is None)
    return engine, config


def compile_engine(engine, zero_stage: int, pipeline: bool) -> None:
    """--compile: DeepSpeed's engine.compile(), torch.compile of the model it wraps (docs/gpu.md, torch.compile).
    ZeRO-3 gathers a parameter read outside its module's forward when the read goes through the module's parameter
    dict; compiled code reads that dict's tensors directly, and would trace the output layer's weight as its empty
    partition. Registered with the whole model, the model's own forward gathers it first."""
    import deepspeed

    if zero_stage == 3 and not pipeline:
        deepspeed.zero.register_external_parameter(engine.module, engine.module.output_weight())
    engine.compile()


def build_reporter(args: Args, dist_info: DistInfo, schedule: Schedule, ds_config: dict,
                   comm: comm_counter.CommCounter | None = None, engine=None) -> Reporter:
    """Print the run-info line and set up what the loop reports; FLOPs and estimates come from accounting.
    Every rank calls it: the step-time probes run on all ranks at once. With `engine` and ZeRO offload, the
    offloaded optimizer's step is timed."""
    from deepspeed.accelerator import get_accelerator

    from megatron import accounting

    ds, par, model_config = args.deepspeed, args.parallel, args.model
    last_stage = par.pipeline_model_parallel_size - 1
    log_rank = par.layout.logging_rank  # docs/log-lines.md, "Which rank prints"
    setup = training_setup(args, dist_info)
    predictions = LengthPredictions(model_config, setup, last_stage, ds_config.get("zero_optimization", {}))
    device_name = torch.cuda.get_device_name(dist_info.device) if dist_info.on_cuda else get_accelerator().device_name()
    # fp32 matmuls run on the TF32 tensor cores only where torch allows it (off unless a user turns it on)
    tf32 = dist_info.on_cuda and torch.backends.cuda.matmul.allow_tf32
    peak = accounting.peak_tflops(device_name, ds.precision, tf32)
    reporter = Reporter(
        args=args, dist_info=dist_info, schedule=schedule, predictions=predictions, peak_tflops=peak,
        tracker=memory.MemoryTracker(on_cuda=dist_info.on_cuda), log_rank=log_rank, comm=comm,
        num_params=accounting.count_parameters(model_config))
    reporter.print_line(run_info_line(ds.zero_stage, ds.offload, args.model_name, dist_info.world_size,
                                  args.training.micro_batch_size, args.training.global_batch_size,
                                  args.model.seq_length, schedule.samples_per_epoch,
                                  [n for n in model_config.layer_experts if n > 1],
                                  model_config.moe_expert_parallel_size, model_config.topk,
                                  args.parallel.sequence_parallel_size))
    for line in args.notes:  # the Megatron-DeepSpeed flags accepted in place of what zero-lab does itself
        reporter.print_line(line)
    if dist_info.rank == log_rank:
        reporter.writers = open_writers(args, schedule, ds_config, reporter.print_line)
    reporter.print_line(parameters_line(*predicted_parameters(model_config, par, last_stage),
                                        None if engine is None else measured_parameters(engine)))
    reporter.print_line(peak_line(device_name, accounting.accelerator_part(device_name),
                                  accounting.matmul_precision(ds.precision, tf32), peak))
    if probes_skipped():
        reporter.print_line(PROBES_SKIPPED_LINE)
    else:
        predicted, predictions.rates, predictions.link, predictions.host = predict_at_startup(
            args, dist_info, ds_config, setup, comm, TrainerSteps(setup_engine, train_step, get_batch))
        reporter.print_line(probe_line(predictions.rates, predictions.link, predicted, predictions.host))
    if engine is not None and ds.offload_optimizer and par.pipeline_model_parallel_size == 1:
        reporter.offload_clock = OffloadStepClock(comm, dist_info.on_cuda)
        reporter.offload_clock.install(engine)
    return reporter


def predicted_parameters(config, par, stage: int) -> tuple[int, int, int]:
    """(the model's parameters, those active per token, those the printing rank of pipeline `stage` holds)."""
    from megatron import accounting

    on_rank = accounting.parameters_on_rank(config, par.tensor_model_parallel_size, par.pipeline_model_parallel_size,
                                            stage)
    experts = sum(map(sum, accounting.expert_groups_on_rank(config, config.moe_expert_parallel_size)))
    return accounting.count_parameters(config), accounting.active_parameters(config), on_rank + experts


def measured_parameters(engine) -> int:
    """Parameters this rank's module holds, whole (ZeRO-3's gathered size, not its partition)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())


def open_writers(args: Args, schedule: Schedule, ds_config: dict, print_line) -> list:
    """The scalar writers the flags ask for (--tensorboard-dir, --wandb-project), for the rank that prints. A wandb
    that cannot be imported or started is left out, in one line through print_line: the run trains on."""
    log = args.logging
    writers = [TensorBoardWriter(log.tensorboard_dir, log.tensorboard_queue_size)] if log.tensorboard_dir else []
    if log.wandb_project:
        from megatron.wandb_writer import open_wandb, run_config
        writer, why_not = open_wandb(log.wandb_project, log.wandb_exp_name, log.wandb_save_dir,
                                     args.deepspeed.run_dir, run_config(args, schedule, ds_config))
        writers += [writer] if writer is not None else []
        if why_not:
            print_line(why_not)
    return writers


def training_setup(args: Args, dist_info: DistInfo):
    """What megatron/accounting/predict/'s traffic and memory estimates need from the parsed flags."""
    from megatron import accounting

    ds, par, train = args.deepspeed, args.parallel, args.training
    return accounting.TrainingSetup(
        world_size=par.world_size, micro_batch_size=train.micro_batch_size,
        gradient_accumulation_steps=train.gradient_accumulation_steps,
        tensor_parallel_size=par.tensor_model_parallel_size, pipeline_parallel_size=par.pipeline_model_parallel_size,
        sequence_parallel=par.sequence_parallel, sequence_parallel_size=par.sequence_parallel_size,
        expert_parallel_size=args.model.moe_expert_parallel_size, precision=ds.precision, zero_stage=ds.zero_stage,
        offload_optimizer=ds.offload_optimizer, offload_params=ds.offload_params,
        offload_device="nvme" if ds.nvme_path else "cpu", activation_recompute=args.model.recompute_activations,
        device="cuda" if dist_info.on_cuda else "cpu", reduce_precision=_user_reduce_precision(ds.user_config))


def _user_reduce_precision(user_config: dict | None) -> str | None:
    """A user's DeepSpeed JSON's communication_data_type (None where it leaves it to the generated config's)."""
    value = (user_config or {}).get("communication_data_type")
    return value.lower() if isinstance(value, str) else None
