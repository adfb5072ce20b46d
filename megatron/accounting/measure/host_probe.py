"""The engine's host work per counted item, measured at start-up on a skeleton: the run's module tree (its layers,
modules, ZeRO stage, precision and parallel groups) at a tiny width, in a real DeepSpeed engine, never the run's
own steps (megatron/accounting/predict/host_work.py counts the items and says what the coefficients mean).

Each skeleton variant trains a few steps of one micro-batch; its host work is the step's wall time less the time
blocked in collectives (a comm counter of its own, megatron/accounting/measure/comm_counter.py) and less the bare
model's forward and
backward at the same width (the compute probe's part at the run's width). Two variants differ in their bucket sizes
(one bucket per reduction; a bucket per tensor), and at stage 3 a third in its tensors per module (no linear
biases); a least-squares fit over them gives the seconds per tensor, per module hook and per flush. A host
synchronisation is timed on its own: a value read back after a kernel. Every rank calls it at the same time.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist

from megatron.accounting.measure import comm_counter
from megatron.accounting import TrainingSetup, count_parameters
from megatron.accounting.predict.host_work import HostCoefficients, host_counts
from megatron.accounting.predict.step_time import _modules

HEAD_DIM = 2  # the skeleton's width: two channels a head, the run's heads and K/V heads
SEQ_PER_RANK = 8  # tokens a sequence holds on each DeepSpeed-Ulysses rank
STEPS = 3  # timed steps of each variant, after one warm-up; the shortest is kept (comm_probe.fastest_seconds)
WHOLE = 10**9  # bucket elements no skeleton reaches: one bucket a reduction, every gather at once
TENSOR = 2  # bucket elements below every tensor's: a bucket per tensor (DeepSpeed wants a multiple of 2)
SYNC_REPEATS = 50



@dataclasses.dataclass(frozen=True)
class TrainerSteps:
    """The trainer's own functions the skeletons run, passed down from megatron/training.py's trainer_steps() (this
    module sits below the loop): megatron/engine.py's setup_engine, the loop's train_step and get_batch."""
    setup_engine: Callable
    train_step: Callable
    get_batch: Callable

def skeleton_args(args):
    """The run's flags at a tiny width: one micro-batch of one sample per data-parallel rank, a short
    sequence, a vocabulary of 64 per TP rank, no compilation, no NVMe."""
    model, par = args.model, args.parallel
    hidden = HEAD_DIM * model.num_attention_heads
    seq = SEQ_PER_RANK * par.sequence_parallel_size
    config = dataclasses.replace(model, hidden_size=hidden, ffn_hidden_size=2 * hidden, seq_length=seq,
                                 max_position_embeddings=seq, padded_vocab_size=64 * par.tensor_model_parallel_size)
    data_parallel = par.world_size // (par.tensor_model_parallel_size * par.pipeline_model_parallel_size
                                       * par.sequence_parallel_size)
    training = dataclasses.replace(args.training, micro_batch_size=1, global_batch_size=data_parallel,
                                   gradient_accumulation_steps=1, compile=False)
    # NVMe offload's swap files would sit beside the run's engine's: the skeleton offloads to host memory instead
    deepspeed = dataclasses.replace(args.deepspeed, nvme_path=None)
    return dataclasses.replace(args, model=config, training=training, deepspeed=deepspeed)


def persistence_threshold(run_config, skeleton_config, setup: TrainingSetup, run_threshold: int) -> int:
    """The skeleton's stage3_param_persistence_threshold that keeps whole the tensors the run keeps whole (its
    biases and LayerNorms), so that it gathers what the run gathers: the largest skeleton size among them."""
    tp, pp = setup.tensor_parallel_size, setup.pipeline_parallel_size
    run = [n for module in _modules(run_config, tp, pp, pp - 1) for n in module.sizes]
    skeleton = [n for module in _modules(skeleton_config, tp, pp, pp - 1) for n in module.sizes]
    return max((s for r, s in zip(run, skeleton) if r <= run_threshold), default=0)


def _batches(args, device):
    vocab, seq = args.model.padded_vocab_size, args.model.seq_length
    generator = torch.Generator().manual_seed(0)
    return iter(lambda: {"text": torch.randint(0, vocab - 1, (1, seq + 1), generator=generator)}, None)


def _builder(args, dist_info):
    from megatron.model import GPTModel
    from megatron.model.moe import expert_rank

    parallel = dist_info.parallel
    return partial(GPTModel, args.model, parallel.get_tensor_model_parallel_group(),
                   parallel.get_sequence_parallel_group(),
                   expert_rank=expert_rank(args.model, parallel.data.rank))


def _timed(step, device, group) -> float:
    dist.barrier(group=group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def bare_seconds(args, dist_info, get_batch: Callable) -> float:
    """The skeleton model's forward and backward alone, no engine: the part of its step that is not host work
    of the engine's (the compute probe prices it at the run's width)."""
    model = _builder(args, dist_info)().to(dist_info.device).train()
    data = _batches(args, dist_info.device)

    def step():
        tokens, labels, positions, _ = get_batch(next(data), dist_info.device, args.model.padded_vocab_size - 1,
                                                 False, dist_info.parallel.sequence)
        model(tokens, positions, labels).float().mean().backward()
    step()
    return min(_timed(step, dist_info.device, None) for _ in range(STEPS))


def variant_seconds(args, dist_info, zero: dict, steps: TrainerSteps) -> tuple[float, dict]:
    """(seconds of a skeleton engine's step outside collectives, the zero_optimization section it ran with)."""
    train_step = steps.train_step
    engine, config = steps.setup_engine(_builder(args, dist_info), count_parameters(args.model), args, dist_info,
                                  train_iters=STEPS + 1, zero_overrides=zero)
    data, eod = _batches(args, dist_info.device), args.model.padded_vocab_size - 1
    counter = comm_counter.CommCounter()
    comm_counter.install(counter)
    best = float("inf")
    with counter.counting():
        train_step(engine, data, args, dist_info, eod)
        for _ in range(STEPS):
            before = sum(counter.seconds().values())
            wall = _timed(lambda: train_step(engine, data, args, dist_info, eod), dist_info.device, None)
            best = min(best, wall - (sum(counter.seconds().values()) - before))
    engine.destroy()
    return best, config["zero_optimization"]


def sync_seconds(device: torch.device) -> float:
    """One host read of a value a kernel just wrote (`.item()`), median over SYNC_REPEATS."""
    value = torch.zeros((), device=device)
    seconds = []
    for _ in range(SYNC_REPEATS):
        start = time.perf_counter()
        value.add_(1).item()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def fit(rows: list[tuple[float, float, float]], seconds: list[float]) -> tuple[float, float, float]:
    """Non-negative (per tensor, per module hook, per flush) seconds from the variants' counts and seconds: a
    least-squares fit, a negative coefficient dropped and the rest fitted again; the columns no variant counts
    are 0."""
    active = [c for c in range(3) if any(row[c] for row in rows)]
    while active:
        a = torch.tensor([[row[c] for c in active] for row in rows], dtype=torch.float64)
        b = torch.tensor(seconds, dtype=torch.float64).unsqueeze(1)
        solution = torch.linalg.lstsq(a, b).solution.squeeze(1).tolist()
        if min(solution) >= 0:
            return tuple(solution[active.index(c)] if c in active else 0.0 for c in range(3))
        active.pop(solution.index(min(solution)))
    return 0.0, 0.0, 0.0


def probe_host(args, dist_info, setup: TrainingSetup, zero: dict, comm: comm_counter.CommCounter | None,
               steps: TrainerSteps) -> HostCoefficients | None:
    """HostCoefficients of this rank from the skeleton variants, every rank agreeing on the largest; None under
    pipeline parallelism (the skeleton is the non-pipeline GPTModel). `comm`: the run's comm counter, put back
    after the probe (None: none installed)."""
    if setup.pipeline_parallel_size > 1:
        return None
    started = time.perf_counter()
    skeleton = skeleton_args(args)
    small = dataclasses.replace(setup, micro_batch_size=1, gradient_accumulation_steps=1)
    threshold = persistence_threshold(args.model, skeleton.model, setup,
                                      int(zero.get("stage3_param_persistence_threshold", 100_000)))
    buckets = dict(stage3_param_persistence_threshold=threshold, stage3_max_live_parameters=WHOLE)
    variants = [(skeleton, dict(buckets, reduce_bucket_size=WHOLE, allgather_bucket_size=WHOLE,
                                stage3_prefetch_bucket_size=WHOLE)),
                (skeleton, dict(buckets, reduce_bucket_size=TENSOR, allgather_bucket_size=TENSOR,
                                stage3_prefetch_bucket_size=TENSOR))]
    if setup.zero_stage == 3:
        variants.append((dataclasses.replace(skeleton, model=dataclasses.replace(
            skeleton.model, disable_bias_linear=True)), variants[0][1]))
    try:
        rows, seconds = [], []
        for variant, overrides in variants:
            bare = bare_seconds(variant, dist_info, steps.get_batch)
            wall, section = variant_seconds(variant, dist_info, overrides, steps)
            counts = host_counts(variant.model, small, 0, section)
            rows.append((counts.tensors, counts.module_hooks, counts.flushes))
            seconds.append(max(0.0, wall - bare - counts.syncs * sync_seconds(dist_info.device)))
    finally:
        if comm is None:
            comm_counter.uninstall()
        else:
            comm_counter.install(comm)
    values = torch.tensor([*fit(rows, seconds), sync_seconds(dist_info.device)], dtype=torch.float64,
                          device=dist_info.device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    tensor, module, flush, sync = values.tolist()
    return HostCoefficients(tensor, module, flush, sync, source="probe", seconds=time.perf_counter() - started)
