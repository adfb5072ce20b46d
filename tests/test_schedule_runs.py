"""Real pretrain_gpt.py runs on 2 CPU ranks: the learning rate each log line shows is Megatron-DeepSpeed's (the
oracle of tests/test_lr_schedule.py), --train-tokens stops at the iteration it reaches (a curriculum's steps count
their truncated length), --rampup-batch-size's global batch and consumed samples follow Megatron's ramp, and
--exit-duration-in-mins saves and exits 0, the resumed run continuing the same rates."""
import json
import re
import subprocess

import pytest

from megatron.arguments import OptimizerArgs
from megatron.batch_rampup import BatchRamp
from conftest import test_env
from runs import SKIP_PROBES, pretrain_cmd, run_pretrain
from test_curriculum import LENGTHS as CURRICULUM_LENGTHS
from test_curriculum import SECTION as CURRICULUM_SECTION
from test_lr_schedule import megatron_loop

pytestmark = pytest.mark.slow  # each run starts 2 ranks: 10-30 s on 2 cores

ITERATION = re.compile(r" iteration +(\d+)/ +\d+ \| consumed samples: +(\d+) \| consumed tokens: +(\d+) \|.*?"
                       r"\| learning rate: (\S+) \| global batch size: +(\d+) \| lm loss: (\S+) \|")
SCHEDULE = ("--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "3", "--lr-decay-style", "linear")
GLOBAL_BATCH, SEQ = 8, 64  # runs.pretrain_cmd's


def logged(stdout: str) -> list[tuple[int, int, int, str, int, float]]:
    """(iteration, consumed samples, consumed tokens, learning rate as printed, global batch, lm loss) per line."""
    return [(int(it), int(samples), int(tokens), lr, int(batch), float(loss))
            for it, samples, tokens, lr, batch, loss in ITERATION.findall(stdout)]


def printed(rates: list[float]) -> list[str]:
    return [f"{rate:.3E}" for rate in rates]


def test_the_log_lines_rate_is_megatron_deepspeeds_and_train_tokens_stops_the_run(dolly_data_dir):
    """Warm-up 3 of 8 iterations, linear decay; --train-tokens 2600 of 512 a step stops after iteration 6 (2560 <
    2600 <= 3072), with the end-of-training line. Before: 3.333E-04 at iteration 1 (a step ahead) and 8 iterations
    (the flag refused by argparse)."""
    out = run_pretrain(dolly_data_dir, *SCHEDULE, "--train-tokens", "2600").stdout
    lines = logged(out)
    _, rates = megatron_loop(OptimizerArgs(lr=1e-3, min_lr=1e-4, lr_warmup_iters=3, lr_decay_style="linear"), 8,
                             [GLOBAL_BATCH] * 8, [SEQ] * 8)
    assert [line[0] for line in lines] == [1, 2, 3, 4, 5, 6]
    assert [line[3] for line in lines] == printed(rates[:6])
    assert [line[2] for line in lines] == [512 * it for it in range(1, 7)]
    assert "[after training is done]" in out


def test_train_tokens_and_the_token_schedule_count_a_curriculums_truncated_steps(dolly_data_dir, tmp_path):
    """Lengths 16, 32, 32, 48, 48, 64, ... x 8 samples: 1408 tokens after iteration 5, 1920 after 6, so
    --train-tokens 1500 stops after 6 (at --seq-length's 512 a step it would stop after 3); the warm-up and decay by
    tokens follow the same count, as Megatron-DeepSpeed's consumed_train_tokens."""
    (tmp_path / "ds.json").write_text(json.dumps({"curriculum_learning": CURRICULUM_SECTION}))
    token_schedule = ("--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-tokens", "1000", "--lr-decay-tokens", "2500")
    out = run_pretrain(dolly_data_dir, "--curriculum-learning-legacy", "--deepspeed_config", str(tmp_path / "ds.json"),
                       *token_schedule, "--train-tokens", "1500").stdout
    lines = logged(out)
    _, rates = megatron_loop(OptimizerArgs(lr=1e-3, min_lr=1e-4, lr_warmup_tokens=1000, lr_decay_tokens=2500), 8,
                             [GLOBAL_BATCH] * 8, CURRICULUM_LENGTHS)
    assert [(line[0], line[2]) for line in lines] == [(1, 128), (2, 384), (3, 640), (4, 1024), (5, 1408), (6, 1920)]
    assert [line[3] for line in lines] == printed(rates[:6])


@pytest.mark.parametrize("layout", [("--zero-stage", "1"), ("--pipeline-model-parallel-size", "2")],
                         ids=["zero1-dp2", "pipeline-pp2"])
def test_the_batch_ramp_sets_each_steps_global_batch_and_consumed_samples(dolly_data_dir, layout):
    """--train-samples 56, --rampup-batch-size 2 2 12 to --global-batch-size 8 at micro-batch 1: global batches 2, 2,
    4, 6, then 8, 9 iterations by Megatron's update_train_iters; the warm-up by samples steps once per iteration by
    its batch. On 2 data-parallel ranks at ZeRO-1 (gradient accumulation 1, 1, 2, 3, 4: DeepSpeed's own boundary
    would fall mid-step from the change to 3) and on DeepSpeed's pipeline engine over 2 stages (its train_batch
    takes 2, 2, 4, 6, 8 micro-batches)."""
    command = pretrain_cmd(dolly_data_dir, 2, "--train-samples", "56", "--rampup-batch-size", "2", "2", "12",
                           "--micro-batch-size", "1", *layout, "--lr-warmup-iters", "0",
                           "--lr-warmup-samples", "16", "--lr", "1e-3", "--min-lr", "1e-4")
    at = command.index("--train-iters")
    del command[at:at + 2]  # sample-based instead
    run = subprocess.run(command, env={**test_env(), **SKIP_PROBES}, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout
    lines = logged(out)
    ramp = BatchRamp.from_flag([2, 2, 12], 8, 1, 2)
    batches, consumed = [], 0
    for _ in range(ramp.train_iters(56)):
        batches.append(ramp.batch_at(consumed))
        consumed += batches[-1]
    assert batches == [2, 2, 4, 6, 8, 8, 8, 8, 8]
    assert [line[4] for line in lines] == batches
    assert [line[1] for line in lines] == [sum(batches[:i + 1]) for i in range(9)]
    _, rates = megatron_loop(OptimizerArgs(lr=1e-3, min_lr=1e-4, lr_warmup_samples=16), 9, batches, [SEQ] * 9,
                             train_samples=56)
    assert [line[3] for line in lines] == printed(rates)
    assert all(line[5] < 11.0 for line in lines)  # finite, and learning


def test_exit_duration_saves_exits_0_and_the_resume_continues_the_rates(dolly_data_dir, tmp_path):
    """--exit-duration-in-mins 0.001 (0.06 s, less than the start-up): after iteration 1 the ranks agree, save and
    exit 0 with Megatron's line; the run resumed from that checkpoint logs the uninterrupted run's rates."""
    save = str(tmp_path / "checkpoints")
    first = run_pretrain(dolly_data_dir, *SCHEDULE, "--save", save, "--exit-duration-in-mins", "0.001").stdout
    assert [line[0] for line in logged(first)] == [1]
    assert "successfully saved checkpoint at iteration        1" in first
    assert re.search(r"\[exiting program after \d+\.\d+ minutes\] datetime: \d{4}-\d\d-\d\d ", first)
    assert "[after training is done]" not in first
    resumed = run_pretrain(dolly_data_dir, *SCHEDULE, "--save", save, "--load", save).stdout
    _, rates = megatron_loop(OptimizerArgs(lr=1e-3, min_lr=1e-4, lr_warmup_iters=3, lr_decay_style="linear"), 8,
                             [GLOBAL_BATCH] * 8, [SEQ] * 8)
    assert logged(first)[0][3] == printed(rates)[0]
    assert [(line[0], line[3]) for line in logged(resumed)] == list(zip(range(2, 9), printed(rates[1:])))
