"""The drivers' micro-batch on a GPU without MICRO_BATCH: the largest the memory model predicts fits the GPU less
its headroom (megatron/accounting/predict/fit.py, megatron/launch/micro_batch.py), tested on CPU against the memory
model's own predictions, and the driver's launch with a stand-in nvidia-smi (docs/gpu.md)."""
import shlex
import sys
from dataclasses import replace

import pytest

from conftest import test_env as subprocess_env  # aliased: pytest would collect test_env as a test
from megatron.launch.drivers import DriverPlanner
from megatron.launch.micro_batch import plan_for_flags
from megatron.model import MODEL_PRESETS, GPTConfig
from megatron.accounting import TrainingSetup, memory_per_rank
from megatron.accounting.predict.fit import HEADROOM, largest_micro_batch

GIB = 2**30
H100 = 81559 * 2**20  # nvidia-smi's memory.total of an H100 80GB HBM3, MiB


def gpt(size: str, seq: int = 1024) -> GPTConfig:
    return GPTConfig(**MODEL_PRESETS[size], seq_length=seq, max_position_embeddings=seq, padded_vocab_size=50304)


def peak(config: GPTConfig, setup: TrainingSetup, micro: int, accumulation: int = 1) -> int:
    return memory_per_rank(config, replace(setup, micro_batch_size=micro, gradient_accumulation_steps=accumulation))[
        "total"]


@pytest.mark.parametrize("stage,offload", [(0, False), (1, False), (2, False), (3, False), (3, True)])
def test_the_plan_is_the_largest_micro_batch_the_memory_model_fits(stage, offload):
    config = gpt("355M")
    setup = TrainingSetup(world_size=1, micro_batch_size=1, precision="bf16", zero_stage=stage,
                          offload_optimizer=offload, offload_params=offload)
    plan = largest_micro_batch(config, setup, H100)
    usable = H100 * (1 - HEADROOM)
    assert plan.fits and plan.accumulation == 1
    assert plan.predicted_bytes == peak(config, setup, plan.micro_batch) <= usable
    assert peak(config, setup, plan.micro_batch + 1) > usable
    assert plan.line() == (f"micro-batch {plan.micro_batch} from the memory plan (predicted "
                           f"{plan.predicted_bytes / GIB:.1f} of 79.6 GiB per GPU: the largest that leaves 10% free); "
                           "MICRO_BATCH sets it")


def test_higher_stages_leave_room_for_larger_micro_batches():
    """8 GPUs: the model states shrink with the stage, the activations do not."""
    config = gpt("1.3B")
    chosen = [largest_micro_batch(config, TrainingSetup(world_size=8, micro_batch_size=1, precision="bf16",
                                                        zero_stage=stage), 40 * GIB).micro_batch
              for stage in (0, 1, 2, 3)]
    assert chosen == sorted(chosen) and chosen[0] < chosen[3]


def test_a_global_batch_takes_only_micro_batches_it_divides_into():
    """GLOBAL_BATCH 96 on 4 GPUs: 24 samples per GPU a step; a micro-batch that does not divide 24 is never
    chosen, and the accumulation makes up the rest."""
    config = gpt("355M")
    setup = TrainingSetup(world_size=4, micro_batch_size=1, precision="bf16", zero_stage=1)
    free = largest_micro_batch(config, setup, 40 * GIB)  # without a global batch
    plan = largest_micro_batch(config, setup, 40 * GIB, global_batch=96)
    assert 24 % plan.micro_batch == 0 and plan.micro_batch * plan.accumulation == 24
    assert plan.micro_batch <= free.micro_batch
    bigger = [m for m in (1, 2, 3, 4, 6, 8, 12, 24) if m > plan.micro_batch]
    assert all(peak(config, setup, m, 24 // m) > 40 * GIB * (1 - HEADROOM) for m in bigger)
    assert plan.predicted_bytes == peak(config, setup, plan.micro_batch, plan.accumulation)


def test_nothing_fitting_takes_micro_batch_one_and_says_so():
    plan = largest_micro_batch(gpt("13B"), TrainingSetup(world_size=1, micro_batch_size=1, precision="bf16"),
                               16 * GIB)
    assert (plan.micro_batch, plan.fits) == (1, False)
    assert plan.line().startswith("micro-batch 1 from the memory plan, which predicts even that over the GPU's "
                                  "memory less 10% (predicted ")


def test_the_plan_reads_the_runs_own_flags():
    """pretrain_gpt.py's flags as the driver gives them (any micro-batch): the same plan as from the config."""
    flags = ["--model-size", "355M", "--seq-length", "1024", "--max-position-embeddings", "1024", "--micro-batch-size",
             "1", "--global-batch-size", "2", "--bf16", "--zero-stage", "2", "--train-iters", "1", "--data-path", "x",
             "--vocab-file", "missing-vocab.json", "--merge-file", "missing-merges.txt"]
    plan = plan_for_flags(flags, 2, H100, None)
    setup = TrainingSetup(world_size=2, micro_batch_size=1, precision="bf16", zero_stage=2)
    assert plan == largest_micro_batch(gpt("355M"), setup, H100)


# --- the driver, on a machine whose nvidia-smi is a stand-in ---

def fake_gpus(folder, mib: int = 81559, count: int = 1):
    folder.mkdir(exist_ok=True)
    listing = "".join(f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i})\\n" for i in range(count))
    memory = "".join(f"{i}, {mib}\\n" for i in range(count))
    (folder / "nvidia-smi").write_text(f'#!/bin/sh\ncase "$*" in *--query-gpu*) printf "{memory}";; '
                                       f'*) printf "{listing}";; esac\n')
    (folder / "nvidia-smi").chmod(0o755)
    return folder


def gpu_driver(tmp_path, capsys, experiment="Z1", **env):
    environment = subprocess_env(RUNS_DIR=tmp_path, DRY_RUN=1, PYTHON=sys.executable, **env)
    environment.pop("CUDA_VISIBLE_DEVICES", None)
    environment["PATH"] = f"{fake_gpus(tmp_path / 'bin', count=int(env.get('NGPUS', 1)))}:{environment['PATH']}"
    launch = DriverPlanner(experiment).plan(environment, [], dry_run=True)
    argv = launch.command
    return capsys.readouterr().out, argv[argv.index("--micro-batch-size") + 1], argv[argv.index(
        "--global-batch-size") + 1]


@pytest.mark.slow
def test_a_gpu_driver_without_micro_batch_takes_the_plans_and_says_why(tmp_path, capsys):
    out, micro, global_batch = gpu_driver(tmp_path, capsys, MODEL_SIZE="355M")
    setup = TrainingSetup(world_size=1, micro_batch_size=1, precision="bf16", zero_stage=1)
    plan = largest_micro_batch(gpt("355M"), setup, H100)
    assert f"[examples_zero] {plan.line()}\n" in out
    assert (micro, global_batch) == (str(plan.micro_batch), str(plan.micro_batch))


@pytest.mark.slow
def test_a_given_micro_batch_or_global_batch_is_kept(tmp_path, capsys):
    out, micro, global_batch = gpu_driver(tmp_path, capsys, MODEL_SIZE="355M", MICRO_BATCH="8")
    assert (micro, global_batch) == ("8", "8") and "memory plan" not in out
    out, micro, global_batch = gpu_driver(tmp_path, capsys, MODEL_SIZE="355M", GLOBAL_BATCH="36", NGPUS="2")
    assert global_batch == "36" and 18 % int(micro) == 0 and f"micro-batch {micro} from the memory plan" in out


def test_cpu_ranks_keep_the_default_micro_batch(tmp_path):
    environment = subprocess_env(RUNS_DIR=tmp_path, DRY_RUN=1, CUDA_VISIBLE_DEVICES="")
    argv = DriverPlanner("Z1").plan(environment, [], dry_run=True).command
    assert argv[argv.index("--micro-batch-size") + 1] == "4"
    assert "--compile" not in argv
    argv = DriverPlanner("Z1").plan(dict(environment, COMPILE="1"), [], dry_run=True).command
    assert "--compile" in argv and shlex.join(argv)
