"""The training loop: a step over the micro-batches, evaluation, logging, checkpoints.

DeepSpeed does ZeRO partitioning, offload, mixed precision, clipping and gradient accumulation;
this file feeds it batches and turns the loss into the masked mean. What the loop prints is the report's
(megatron/accounting/report.py); the engine is built in megatron/engine.py.
"""
import contextlib
import math
import time

import torch
import torch.distributed as dist

from megatron.accounting.measure import memory
from megatron.accounting.measure.host_probe import TrainerSteps
from megatron.accounting.report import Reporter
from megatron.arguments import Args
from megatron.checkpointing import interval
from megatron.checkpointing.save_load import save_checkpoint
from megatron.curriculum import SeqlenCurriculum
from megatron.engine import setup_engine
from megatron.errors import ZeroLabError
from megatron.exit_signal import ExitSignalHandler, minutes_past
from megatron.initialize import DistInfo
from megatron.loop_state import LoopState, Schedule, StepResult
from megatron.model import moe
from megatron.runtime.dist_env import all_ranks_on_this_host
from megatron.training_log import exit_duration_line


class TrainingError(ZeroLabError, RuntimeError):
    """Training cannot go on (e.g. too many NaN iterations in a row); the message says why."""


# --exit-signal-handler: the ranks agree on the SIGTERM flag (a collective and a host sync) every
# min(--log-interval, this) iterations, not after every step (docs/checkpoints.md)
EXIT_SIGNAL_POLL_STEPS = 10


def get_batch(batch: dict, device: torch.device, eod: int, eod_mask_loss: bool, sequence=None):
    """Shift the (seq_length + 1)-token samples into inputs and labels; positions 0..s-1. With `eod_mask_loss`,
    the loss leaves out each position whose input is the end-of-document id (the prediction across a document
    boundary), as Megatron-DeepSpeed's get_ltor_masks_and_position_ids does; the prediction of the id is trained.
    With `sequence`, a DeepSpeed-Ulysses group (its rank and size): this rank's slice of every sample, at its
    global positions (the group's ranks read the same samples), each a copy of its own: the embedding saves the
    token and position ids for its backward, and a view (Megatron-DeepSpeed slices views) would keep the whole
    sample's ids alive, 8 bytes per token of the whole sequence each at micro-batch 1."""
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
    return tuple(t[:, mine].clone(memory_format=torch.contiguous_format)
                 for t in (tokens, labels, position_ids, loss_mask))


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
    gradients held after each backward (their peak), the first micro-batch's activations and, on CPU ranks, the
    peak its forward and backward hold beyond the model states (memory.step_peak_bytes; on CUDA not measured)."""
    losses = []
    grad_bytes, activations, offloaded, peak = 0, None, 0, None
    # the engine's count: --rampup-batch-size changes it between steps
    accumulation = engine.gradient_accumulation_steps()
    for micro in range(accumulation):
        # DeepSpeed's own boundary counts micro-batches since the run began: after a change of the
        # accumulation steps it would fall in the middle of a step
        engine.set_gradient_accumulation_boundary(micro == accumulation - 1)
        tokens, labels, position_ids, loss_mask = get_batch(next(data_iterator), dist_info.device, eod,
                                                            args.training.eod_mask_loss, dist_info.parallel.sequence)
        measure = probe_memory and micro == 0
        probe_peak = measure and not dist_info.on_cuda
        with memory.step_peak_bytes(engine) if probe_peak else contextlib.nullcontext() as step_peak:
            with memory.saved_activation_bytes(engine.module) if measure else contextlib.nullcontext() as saved:
                per_token_loss = engine(tokens, position_ids, labels)
            if measure:
                activations = saved[0]
                offloaded = memory.host_tier_bytes() if args.model.recompute_offload else 0
            loss, whole = sequence_mean_loss(per_token_loss, loss_mask, dist_info.parallel.sequence)
            loss = with_moe_loss(loss, engine.module, args.training.moe_loss_coeff)
            engine.backward(loss * sequence_gradient_factor(args.deepspeed.zero_stage, dist_info.parallel.sequence))
        if probe_peak:
            peak = step_peak[0]
        losses.append(whole)
        if probe_memory:
            grad_bytes = max(grad_bytes, memory.grad_bytes(engine))
        engine.step()
    skipped = not engine.was_step_applied()
    # fp16 overflow skips are loss-scale housekeeping; anywhere else a skipped step means inf/nan grads
    nan = skipped and args.deepspeed.precision != "fp16"
    return StepResult(loss=torch.stack(losses).mean(), skipped=skipped, nan=nan, grad_norm=engine.get_global_grad_norm(),
                      grad_bytes=grad_bytes, activation_bytes=activations, offloaded_activation_bytes=offloaded,
                      step_peak_bytes=peak)


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


def trainer_steps() -> TrainerSteps:
    """This file's step and batch functions, with the engine set-up, for the start-up host probe's skeleton engines
    (megatron/accounting/report.py's build_reporter hands them on; the accounting sits below this file)."""
    return TrainerSteps(setup_engine, train_step, get_batch)


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
