"""The in-run report: the lines the loop prints at start-up and at each logging interval (docs/log-lines.md), the
scalars it hands its writers (TensorBoard, wandb), and the progress line's clock. Built once by build_reporter,
beside what it reports against: the predictions (megatron/accounting/predict/) and the measurements
(megatron/accounting/measure/)."""
import contextlib
import math
import time
from collections import deque
from dataclasses import dataclass, field, replace

import psutil
import torch
import torch.distributed as dist

from megatron.accounting.length_predictions import LengthPredictions
from megatron.accounting.measure import comm_counter, memory
from megatron.accounting.measure.host_probe import TrainerSteps
from megatron.accounting.measure.step_timing import (PROBES_SKIPPED_LINE, OffloadStepClock, predict_at_startup,
                                                     probes_skipped)
from megatron.accounting.predict.memory import async_save_copy_bytes
from megatron.arguments import Args
from megatron.accounting.run_setup import training_setup
from megatron.initialize import DistInfo
from megatron.loop_state import LoopState, Schedule, StepResult
from megatron.model import moe
from megatron.optimizer_states import optimizer_state_scalars
from megatron.training_log import (IterationStats, MoEStats, TensorBoardWriter, comm_line, comm_scalars, epoch_line,
                                   iteration_line, iteration_scalars, memory_line, memory_scalars, model_state_line,
                                   parameters_line, peak_line, probe_line, progress_line, run_info_line, time_line,
                                   time_scalars, timer_scalars, validation_line, validation_scalars)


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
            if self.args.model.recompute_offload:  # --checkpoint-in-cpu's host tier
                measured["activations_offloaded"] = probed.offloaded_activation_bytes
        if probed.step_peak_bytes is not None:  # on CPU ranks: the first micro-batch's peak beyond the model states
            measured["step_peak"] = probed.step_peak_bytes
        # what else is allocated (the output-layer buffer, bucket and communication buffers); the CUDA
        # counter does not see host memory, so there the offloaded states are not subtracted
        measured["other"] = max(0, mem["allocated"] - (held - offloaded if self.dist_info.on_cuda else held))
        # ZeRO partitions over data- x DeepSpeed-Ulysses sequence-parallel ranks (as the estimate does)
        partitions = self.predictions.setup.zero_partitions
        estimate = self.predictions.at(seq_length).memory
        if self.args.checkpoint.async_save:  # the host copy the saves will hold, sized before the first one
            from megatron.checkpointing.async_save import copy_bytes
            measured["async_save_copy"] = copy_bytes(engine)
            estimate = {**estimate, "async_save_copy": async_save_copy_bytes(
                self.predictions.config, self.predictions.setup, self.predictions.stage)}
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


def build_reporter(args: Args, dist_info: DistInfo, schedule: Schedule, ds_config: dict, steps: TrainerSteps,
                   comm: comm_counter.CommCounter | None = None, engine=None) -> Reporter:
    """Print the run-info line and set up what the loop reports; FLOPs and estimates come from accounting.
    Every rank calls it: the step-time probes run on all ranks at once. `steps`: the trainer's functions the host
    probe's skeleton engines run (megatron/training.py's trainer_steps()). With `engine` and ZeRO offload, the
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
                                  model_config.expert_parallel_size, model_config.topk,
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
            args, dist_info, ds_config, setup, comm, steps)
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
    experts = sum(map(sum, accounting.expert_groups_on_rank(config, config.expert_parallel_size)))
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
