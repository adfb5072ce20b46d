"""The sequence-length curriculum (--curriculum-learning-legacy, docs/curriculum.md): DeepSpeed's scheduler gives
each step's length, the batches are cut to it, the log and the token count follow it, a resume continues it,
and each bad setting is refused in one line."""
import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from analysis.log_parser import ParsedLog, parse_line
from megatron.arguments import ConfigError, parse_args
from megatron.curriculum import CurriculumConfig, SeqlenCurriculum
from megatron.deepspeed_config import deepspeed_config
from megatron.accounting.length_predictions import LengthPredictions
from megatron import accounting
from megatron.model.config import GPTConfig
from megatron.training import get_batch
from megatron.training_log import IterationStats, iteration_line
from conftest import test_env
from runs import pretrain_cmd, run_pretrain

# 8 iterations of the tiny model at --seq-length 64: 16 at step 1, up by multiples of 16, 64 from step 6 on
SECTION = {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 16, "max_difficulty": 64,
           "schedule_type": "fixed_linear", "schedule_config": {"total_curriculum_step": 6, "difficulty_step": 16}}
LENGTHS = [16, 32, 32, 48, 48, 64, 64, 64]  # DeepSpeed's fixed_linear: floor(i / 6 x 48 + 16), down to 16's
GLOBAL_BATCH = 8  # runs.pretrain_cmd's


def test_the_schedule_is_deepspeeds_fixed_linear():
    curriculum = SeqlenCurriculum(CurriculumConfig(16, 64, 6, 16))
    assert [curriculum.update(step) for step in range(1, 9)] == LENGTHS
    # a run resumed at iteration 3 asks for step 4 first, and gets what the uninterrupted run got
    assert [SeqlenCurriculum(CurriculumConfig(16, 64, 6, 16)).update(step) for step in (4, 7)] == [48, 64]


def test_batches_are_cut_to_the_current_length():
    curriculum = SeqlenCurriculum(CurriculumConfig(16, 64, 6, 16))
    text = torch.arange(2 * 65).reshape(2, 65)
    batches = curriculum.truncating(iter([{"text": text}] * 2))
    curriculum.update(2)
    tokens, labels, positions, loss_mask = get_batch(next(batches), torch.device("cpu"), eod=0, eod_mask_loss=False)
    assert tokens.shape == labels.shape == positions.shape == loss_mask.shape == (2, 32)
    assert torch.equal(tokens, text[:, :32]) and torch.equal(labels, text[:, 1:33])  # the first 32 tokens
    assert torch.equal(positions[0], torch.arange(32))
    curriculum.update(6)
    assert next(batches)["text"].shape == (2, 65)


def test_iteration_line_shows_the_length_where_megatron_deepspeed_does():
    stats = IterationStats(iteration=2, train_iters=8, consumed_samples=16, consumed_tokens=384, elapsed_ms=10.0,
                           learning_rate=1e-3, global_batch_size=8, lm_loss=10.5, loss_scale=1.0, grad_norm=1.5,
                           skipped_iterations=0, nan_iterations=0, samples_per_second=800.0,
                           tokens_per_gpu_per_second=12800.0, tflops=0.01, curriculum_seqlen=32)
    line = iteration_line(stats)
    assert "| grad norm: 1.500 | curriculum seqlen:    32 | number of skipped iterations:" in line
    log = ParsedLog(Path("train.log"))
    parse_line(log, line)
    [record] = log.iterations
    assert (record.curriculum_seqlen, record.consumed_tokens, record.tgs) == (32, 384, 12800.0)
    stats.curriculum_seqlen = None
    assert "curriculum" not in iteration_line(stats)


def test_flops_memory_and_traffic_are_predicted_at_the_steps_length():
    config = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64,
                       max_position_embeddings=64, padded_vocab_size=1024)
    setup = accounting.TrainingSetup(world_size=2, micro_batch_size=2, gradient_accumulation_steps=2, zero_stage=1,
                                     device="cpu")
    predictions = LengthPredictions(config, setup, stage=0, zero={"stage": 1})
    short = GPTConfig(**{**vars(config), "seq_length": 16})
    assert predictions.at(16).model_flops == accounting.model_flops_per_iteration(short, 8)
    assert predictions.at(16).hardware_flops == accounting.hardware_flops_per_iteration(short, 8)
    assert predictions.at(16).memory == accounting.memory_per_rank(short, setup)
    assert predictions.at(16).memory["activations"] < predictions.at(64).memory["activations"]
    assert predictions.at(64).model_flops == accounting.model_flops_per_iteration(config, 8)
    # an interval's figure is the mean over its steps; the memory is the last step's
    mixed = predictions.over([16, 64])
    assert mixed.model_flops == pytest.approx((predictions.at(16).model_flops + predictions.at(64).model_flops) / 2)
    assert mixed.memory == predictions.at(64).memory and mixed.time is None


def parse(data_prefix, tmp_path, section, *extra, world_size=2):
    """parse_args of a small model with a --deepspeed_config holding `section` as its curriculum_learning."""
    user = tmp_path / "ds.json"
    user.write_text(json.dumps({} if section is None else {"curriculum_learning": section}))
    return parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length",
                       "64", "--micro-batch-size", "2", "--train-iters", "10", "--data-path", data_prefix,
                       "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--deepspeed_config", str(user),
                       *extra], world_size=world_size)


def test_section_and_flag_give_the_schedule_deepspeed_never_sees(data_prefix, tmp_path):
    args = parse(data_prefix, tmp_path, SECTION, "--curriculum-learning-legacy")
    assert args.curriculum == CurriculumConfig(16, 64, 6, 16)
    # DeepSpeed 0.19 refuses the legacy key: the config it gets has none
    assert "curriculum_learning" not in deepspeed_config(args, 1000, 64, on_cuda=False)
    assert parse(data_prefix, tmp_path, dict(SECTION, enabled=False)).curriculum is None


def test_the_jsons_enabled_section_turns_the_curriculum_on_without_the_flag(data_prefix, tmp_path):
    """Megatron-DeepSpeed has no flag for it: its scripts (ds_pretrain_gpt_1.3B_rope_slw.sh) pass only the JSON,
    whose curriculum_learning.enabled sets args.curriculum_learning_legacy."""
    assert parse(data_prefix, tmp_path, SECTION).curriculum == CurriculumConfig(16, 64, 6, 16)


def changed(**keys):
    section = json.loads(json.dumps(SECTION))
    for key, value in keys.items():
        if key in ("total_curriculum_step", "difficulty_step"):
            section["schedule_config"][key] = value
        else:
            section[key] = value
    return section


REFUSALS = {
    "flag without section": (None, ("--curriculum-learning-legacy",),
                             "--curriculum-learning-legacy needs a --deepspeed_config JSON whose curriculum_learning "
                             "section has \"enabled\": true (it has no curriculum_learning section"),
    "flag, section disabled": (changed(enabled=False), ("--curriculum-learning-legacy",),
                               "(its curriculum_learning.enabled is False"),
    "min > max": (changed(min_difficulty=64, max_difficulty=32), ("--curriculum-learning-legacy",),
                  "curriculum_learning.min_difficulty 64 is larger than max_difficulty 32"),
    "max > seq": (changed(max_difficulty=128), ("--curriculum-learning-legacy",),
                  "curriculum_learning.max_difficulty 128 is longer than --seq-length 64"),
    "step not dividing": (changed(min_difficulty=8), ("--curriculum-learning-legacy",),
                          "curriculum_learning.schedule_config.difficulty_step 16 does not divide min_difficulty 8"),
    "zero step": (changed(difficulty_step=0), ("--curriculum-learning-legacy",),
                  "curriculum_learning.schedule_config.difficulty_step must be an integer >= 1, got 0"),
    "missing total": (changed(total_curriculum_step=None), ("--curriculum-learning-legacy",),
                      "curriculum_learning.schedule_config.total_curriculum_step must be an integer >= 1, got None"),
    "other schedule": (changed(schedule_type="fixed_root"), ("--curriculum-learning-legacy",),
                       "curriculum_learning.schedule_type must be 'fixed_linear'"),
    "other metric": (changed(curriculum_type="vocabularyrarity"), ("--curriculum-learning-legacy",),
                     "curriculum_learning.curriculum_type must be 'seqlen'"),
    "pipeline": (SECTION, ("--curriculum-learning-legacy", "--pipeline-model-parallel-size", "2"),
                 "--curriculum-learning-legacy cannot be combined with pipeline parallelism"),
    "sequence parallel": (changed(min_difficulty=3, max_difficulty=63, difficulty_step=3),
                          ("--curriculum-learning-legacy", "--tensor-model-parallel-size", "2",
                           "--sequence-parallel"),
                          "the curriculum's difficulty_step 3 must be a multiple of 2"),
    "ulysses": (changed(min_difficulty=3, max_difficulty=63, difficulty_step=3),
                ("--curriculum-learning-legacy", "--ds-sequence-parallel-size", "2"),
                "--ds-sequence-parallel-size 2 splits each sequence over 2 ranks: the curriculum's difficulty_step 3 "
                "must be a multiple of 2"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_each_bad_setting_is_refused_in_one_line(data_prefix, tmp_path, case):
    section, flags, expected = REFUSALS[case]
    with pytest.raises(ConfigError) as err:
        parse(data_prefix, tmp_path, section, *flags)
    assert expected in str(err.value) and "\n" not in str(err.value)


ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \| consumed samples:\s+\d+ \| consumed tokens:\s+(\d+) \|"
                       r".*? curriculum seqlen:\s+(\d+) \|")
TGS = re.compile(r"iteration\s+(\d+)/.*?elapsed time per iteration \(ms\): ([\d.]+) \|.*?\(tgs\): ([\d.]+) \|")
PREDICTED_COMPUTE = re.compile(r"time at iteration\s+(\d+) \|.*?predicted: compute=([\d.]+)ms")


def logged(stdout: str) -> dict[int, tuple[int, int]]:
    """{iteration: (consumed tokens, curriculum seqlen)} of the iteration lines."""
    return {int(it): (int(tokens), int(seqlen)) for it, tokens, seqlen in ITERATION.findall(stdout)}


@pytest.mark.slow
def test_two_rank_runs_follow_the_schedule_and_a_resume_continues_it(dolly_data_dir, tmp_path):
    """Real DeepSpeed on 2 CPU ranks: the logged lengths are the schedule's, the consumed tokens and tgs count each
    step's length, the predicted step time follows it, and a run stopped at iteration 3 (--exit-interval) and
    resumed logs what the uninterrupted run did."""
    (tmp_path / "ds.json").write_text(json.dumps({"curriculum_learning": SECTION}))
    flags = ("--curriculum-learning-legacy", "--deepspeed_config", str(tmp_path / "ds.json"), "--zero-stage", "1")
    # with the start-up probes, for the time lines
    run = subprocess.run(pretrain_cmd(dolly_data_dir, 2, *flags), env=test_env(ZERO_LAB_SKIP_PROBES=0),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    whole = logged(run.stdout)
    tokens = list(np.cumsum([GLOBAL_BATCH * length for length in LENGTHS]))
    assert whole == {it: (tokens[it - 1], LENGTHS[it - 1]) for it in range(1, 9)}
    assert len(TGS.findall(run.stdout)) == 8
    for it, ms, tgs in TGS.findall(run.stdout):  # B x L / t / N, at the step's own length
        assert float(tgs) * float(ms) / 1000 * 2 / GLOBAL_BATCH == pytest.approx(LENGTHS[int(it) - 1], rel=0.01)
    compute = {LENGTHS[int(it) - 1]: float(ms) for it, ms in PREDICTED_COMPUTE.findall(run.stdout)}
    assert list(compute) == [16, 32, 48, 64] and sorted(compute.values()) == list(compute.values())
    assert compute[16] < compute[64]

    save = str(tmp_path / "checkpoints")
    first = run_pretrain(dolly_data_dir, *flags, "--save", save, "--exit-interval", "3").stdout
    assert logged(first) == {it: whole[it] for it in (1, 2, 3)}
    resumed = run_pretrain(dolly_data_dir, *flags, "--save", save, "--load", save).stdout
    assert "loaded checkpoint" in resumed
    assert logged(resumed) == {it: whole[it] for it in range(4, 9)}
