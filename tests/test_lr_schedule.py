"""The learning-rate schedule and stop rules against Megatron-DeepSpeed's (docs/log-lines.md, "Learning rate"):
its OptimizerParamScheduler transcribed below is the oracle for the rate each iteration trains at and the rate its
log line shows, by iterations, fraction, samples and tokens, each decay style, a batch ramp, and a resume; the
batch ramp is its RampupBatchsizeNumMicroBatches and update_train_iters'. The real runs are in
tests/test_schedule_runs.py."""
import math
from dataclasses import replace

import pytest
import torch

from megatron.arguments import ConfigError, OptimizerArgs, parse_args
from megatron.batch_rampup import BatchRamp, BatchRampError
from megatron.optimizer import LRSchedule, ScheduleError


class MegatronScheduler:
    """Megatron-DeepSpeed's OptimizerParamScheduler.get_lr and step (megatron/optimizer_param_scheduler.py),
    transcribed: args.lr_warmup_tokens / lr_decay_tokens are parameters, the weight decay is left out."""

    def __init__(self, max_lr, min_lr, lr_warmup_steps, lr_decay_steps, lr_decay_style, lr_warmup_tokens=None,
                 lr_decay_tokens=None):
        self.max_lr, self.min_lr = float(max_lr), min_lr
        self.lr_warmup_steps, self.num_steps, self.lr_decay_steps = lr_warmup_steps, 0, lr_decay_steps
        self.lr_decay_tokens, self.num_tokens, self.lr_warmup_tokens = lr_decay_tokens, 0, lr_warmup_tokens
        self.lr_decay_style = lr_decay_style
        self.lr = None
        self.step(0, token_num=0)  # its __init__: self.step(0), args.consumed_train_tokens being 0

    def get_lr(self):
        if self.lr_warmup_tokens is None:
            if self.lr_warmup_steps > 0 and self.num_steps <= self.lr_warmup_steps:
                if self.num_steps == self.lr_warmup_steps and self.lr_decay_tokens is not None:
                    self.lr_warmup_tokens = self.num_tokens
                return self.max_lr * float(self.num_steps) / float(self.lr_warmup_steps)
        else:
            if self.lr_warmup_tokens > 0 and self.num_tokens <= self.lr_warmup_tokens:
                return self.max_lr * float(self.num_tokens) / float(self.lr_warmup_tokens)
        if self.lr_decay_style == 'constant':
            return self.max_lr
        if self.lr_decay_tokens is None:
            if self.num_steps > self.lr_decay_steps:
                return self.min_lr
        else:
            if self.num_tokens > self.lr_decay_tokens:
                return self.min_lr
        if self.lr_decay_style == 'inverse-square-root':
            if self.lr_warmup_tokens is None:
                warmup_steps = max(self.lr_warmup_steps, 1)
                num_steps = max(self.num_steps, 1)
                lr = self.max_lr * warmup_steps ** 0.5 / (num_steps ** 0.5)
            else:
                warmup_tokens = max(self.lr_warmup_tokens, 1)
                num_tokens = max(self.num_tokens, 1)
                lr = self.max_lr * warmup_tokens ** 0.5 / (num_tokens ** 0.5)
            return max(self.min_lr, lr)
        if self.lr_decay_tokens is None:
            num_steps_ = self.num_steps - self.lr_warmup_steps
            decay_steps_ = self.lr_decay_steps - self.lr_warmup_steps
            decay_ratio = float(num_steps_) / float(decay_steps_)
        else:
            num_tokens_ = self.num_tokens - self.lr_warmup_tokens
            decay_tokens_ = self.lr_decay_tokens - self.lr_warmup_tokens
            decay_ratio = float(num_tokens_) / float(decay_tokens_)
        assert 0.0 <= decay_ratio <= 1.0
        delta_lr = self.max_lr - self.min_lr
        if self.lr_decay_style == 'linear':
            coeff = (1.0 - decay_ratio)
        elif self.lr_decay_style == 'cosine':
            coeff = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
        return self.min_lr + coeff * delta_lr

    def step(self, increment, token_num):
        self.num_tokens = token_num
        self.num_steps += increment
        self.lr = self.get_lr()


def megatron_steps(opt: OptimizerArgs, train_iters: int, batch: int, train_samples=None):
    """(warm-up steps, decay steps) as its get_optimizer_param_scheduler computes them."""
    if train_samples is None:
        decay = (opt.lr_decay_iters or train_iters) * batch
        warmup = opt.lr_warmup_fraction * decay if opt.lr_warmup_fraction is not None else opt.lr_warmup_iters * batch
    else:
        decay = opt.lr_decay_samples or train_samples
        warmup = opt.lr_warmup_fraction * decay if opt.lr_warmup_fraction is not None else opt.lr_warmup_samples
    return warmup, decay


def megatron_loop(opt, train_iters, batches, lengths, train_samples=None):
    """(the rate each iteration trains at, the rate its log line shows) in Megatron-DeepSpeed's train loop with
    DeepSpeed: the engine steps the scheduler by the iteration's batch inside train_step, before the loop adds the
    iteration's samples and tokens (consumed_train_tokens: batch x its length)."""
    warmup, decay = megatron_steps(opt, train_iters, batches[-1], train_samples)
    oracle = MegatronScheduler(opt.lr, opt.min_lr, warmup, decay, opt.lr_decay_style, opt.lr_warmup_tokens,
                               opt.lr_decay_tokens)
    used, logged, consumed_tokens = [], [], 0
    for batch, length in zip(batches, lengths):
        used.append(oracle.lr)
        oracle.step(increment=batch, token_num=consumed_tokens)
        consumed_tokens += batch * length
        logged.append(oracle.lr)
    return used, logged


def zero_lab_loop(schedule: LRSchedule, batches, lengths, consumed_tokens=0):
    """The same through LRSchedule as training.train drives it (before_step, then DeepSpeed's step())."""
    used, logged = [], []
    for batch, length in zip(batches, lengths):
        used.append(schedule.get_lr()[0])
        schedule.before_step(batch, consumed_tokens)
        schedule.step()
        consumed_tokens += batch * length
        logged.append(schedule.get_lr()[0])
    return used, logged


def assert_rates(got, expected):
    """(rates used, rates logged) equal to float rounding."""
    assert got[0] == pytest.approx(expected[0], rel=1e-12, abs=0)
    assert got[1] == pytest.approx(expected[1], rel=1e-12, abs=0)


def optimizer():
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1.0)


def test_the_issues_warmup_of_4_over_10_iterations():
    """Megatron-DeepSpeed trains at 0, 0.25, 0.5, 0.75, 1.0 x --lr (its scheduler is stepped at 0 when built) and
    logs the rate after each step; zero-lab trained at 0.25, 0.5, 0.75, 1.0, 1.0 (the peak held for two steps)."""
    opt = OptimizerArgs(lr=1.0, lr_warmup_iters=4, lr_decay_style="constant")
    used, logged = zero_lab_loop(LRSchedule(optimizer(), opt, train_iters=10, global_batch_size=8), [8] * 10, [64] * 10)
    assert used == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert logged == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]


CURRICULUM = [16, 32, 32, 48, 48, 64, 64, 64, 64, 64, 64, 64]  # tests/test_curriculum.py's lengths, then whole
CASES = {  # (OptimizerArgs fields, sequence lengths of the 12 iterations of 8 samples)
    "warmup iters, cosine": (dict(lr_warmup_iters=4, lr_decay_iters=10), [64] * 12),
    "warmup iters, linear": (dict(lr_warmup_iters=3, lr_decay_style="linear"), [64] * 12),
    "warmup fraction": (dict(lr_warmup_fraction=0.25, lr_decay_iters=10), [64] * 12),
    "fraction between steps": (dict(lr_warmup_fraction=0.3, lr_decay_style="linear"), [64] * 12),
    "no warmup": (dict(), [64] * 12),
    "constant": (dict(lr_warmup_iters=2, lr_decay_style="constant"), [64] * 12),
    "inverse square root": (dict(lr_warmup_iters=2, lr_decay_style="inverse-square-root"), [64] * 12),
    "warmup tokens, decay tokens": (dict(lr_warmup_tokens=1024, lr_decay_tokens=4000), [64] * 12),
    "tokens under a curriculum": (dict(lr_warmup_tokens=1024, lr_decay_tokens=4000), CURRICULUM),
    "warmup iters, decay tokens": (dict(lr_warmup_iters=3, lr_decay_tokens=3000, lr_decay_style="linear"),
                                   CURRICULUM),
    "warmup tokens, decay iters": (dict(lr_warmup_tokens=700, lr_decay_iters=9), CURRICULUM),
    "inverse square root by tokens": (dict(lr_warmup_tokens=700, lr_decay_style="inverse-square-root"), [64] * 12),
}


@pytest.mark.parametrize("case", CASES)
def test_each_iterations_rate_is_megatron_deepspeeds(case):
    fields, lengths = CASES[case]
    opt = OptimizerArgs(lr=1e-3, min_lr=1e-4, **fields)
    batches = [8] * len(lengths)
    expected = megatron_loop(opt, 12, batches, lengths)
    assert_rates(zero_lab_loop(LRSchedule(optimizer(), opt, 12, global_batch_size=8), batches, lengths), expected)


def test_a_sample_based_schedule_under_a_batch_ramp_is_megatron_deepspeeds():
    """--train-samples 200, --rampup-batch-size 4 4 40 to 16: the schedule counts samples, each step adds its batch."""
    opt = OptimizerArgs(lr=1e-3, min_lr=1e-5, lr_warmup_samples=48, lr_decay_samples=160)
    ramp = BatchRamp.from_flag([4, 4, 40], 16, 2, 2)
    iters = ramp.train_iters(200)
    batches, consumed = [], 0
    for _ in range(iters):
        batches.append(ramp.batch_at(consumed))
        consumed += batches[-1]
    expected = megatron_loop(opt, iters, batches, [64] * iters, train_samples=200)
    schedule = LRSchedule(optimizer(), opt, iters, global_batch_size=16, train_samples=200)
    assert_rates(zero_lab_loop(schedule, batches, [64] * iters), expected)


@pytest.mark.parametrize("case", ["warmup iters, cosine", "warmup iters, decay tokens", "tokens under a curriculum"])
def test_a_resume_continues_megatron_deepspeeds_rates(case):
    """The state DeepSpeed saves (state_dict) loaded into a fresh schedule at iteration 5 (the derived end of a
    warm-up by steps before a decay by tokens included) continues the uninterrupted rates."""
    fields, lengths = CASES[case]
    opt = OptimizerArgs(lr=1e-3, min_lr=1e-4, **fields)
    used, logged = megatron_loop(opt, 12, [8] * 12, lengths)
    first = LRSchedule(optimizer(), opt, 12, global_batch_size=8)
    zero_lab_loop(first, [8] * 5, lengths[:5])
    resumed = LRSchedule(optimizer(), opt, 12, global_batch_size=8)
    resumed.load_state_dict(first.state_dict())
    tokens = sum(8 * length for length in lengths[:5])
    assert_rates(zero_lab_loop(resumed, [8] * 7, lengths[5:], consumed_tokens=tokens), (used[5:], logged[5:]))


def test_a_checkpoint_counted_in_iterations_resumes_at_its_samples():
    """zero-lab's checkpoints before this schedule saved {"num_steps": iterations}."""
    opt = OptimizerArgs(lr=1.0, lr_warmup_iters=4, lr_decay_style="constant")
    schedule = LRSchedule(optimizer(), opt, 10, global_batch_size=8)
    schedule.load_state_dict({"num_steps": 2})
    assert schedule.num_steps == 16 and schedule.get_lr() == [0.5]


def test_an_extended_run_says_its_schedule_changes_and_the_flag_keeps_the_saved_one():
    """Issue 56, item 9: 60 iterations extended to 400 restarted the decay without a word (6.0e-5 to 5.7e-4). The
    flags' schedule is Megatron-DeepSpeed's with --override-opt_param-scheduler (its class values win), and a line
    says so; --use-checkpoint-opt_param-scheduler takes the checkpoint's values, as its _check_and_set does (the
    oracle: its scheduler built with the saved run's values)."""
    opt = OptimizerArgs(lr=6e-4, min_lr=6e-5, lr_warmup_iters=6)
    first = LRSchedule(optimizer(), opt, 60, global_batch_size=8)
    zero_lab_loop(first, [8] * 60, [64] * 60)
    state = first.state_dict()

    extended = LRSchedule(optimizer(), opt, 400, global_batch_size=8)
    extended.load_state_dict(state)
    used, logged = megatron_loop(opt, 400, [8] * 400, [64] * 400)
    assert_rates(zero_lab_loop(extended, [8] * 5, [64] * 5), (used[60:65], logged[60:65]))
    assert extended.resume_note == (
        "note: the flags change the learning-rate schedule the checkpoint was saved with (decay samples (--lr-decay-"
        "iters, else --train-iters, x the global batch; or --lr-decay-samples) 480 -> 3200): the rate goes on at "
        "5.75E-04 where the saved schedule gives 6.00E-05; --use-checkpoint-opt_param-scheduler keeps the saved "
        "schedule")

    kept = LRSchedule(optimizer(), replace(opt, use_checkpoint_opt_param_scheduler=True), 400, global_batch_size=8)
    kept.load_state_dict(state)
    assert kept.resume_note is None
    used, logged = megatron_loop(opt, 60, [8] * 65, [64] * 65)  # the saved schedule, past its end: --min-lr
    assert_rates(zero_lab_loop(kept, [8] * 5, [64] * 5), (used[60:65], logged[60:65]))
    assert logged[60:65] == [6e-5] * 5

    same = LRSchedule(optimizer(), opt, 60, global_batch_size=8)
    same.load_state_dict(state)
    quiet = LRSchedule(optimizer(), replace(opt, override_opt_param_scheduler=True), 400, global_batch_size=8)
    quiet.load_state_dict(state)
    assert same.resume_note is None and quiet.resume_note is None


def test_keeping_the_schedule_of_a_checkpoint_that_did_not_save_it_names_the_flag():
    kept = LRSchedule(optimizer(), OptimizerArgs(use_checkpoint_opt_param_scheduler=True), 10, global_batch_size=8)
    with pytest.raises(ScheduleError) as refused:
        kept.load_state_dict({"num_steps": 16, "num_tokens": 1024, "warmup_tokens": None})
    assert str(refused.value) == ("--use-checkpoint-opt_param-scheduler: the checkpoint was saved before zero-lab "
                                  "recorded its learning-rate schedule: give the schedule's flags as they were")
    with pytest.raises(ConfigError, match="^--use-checkpoint-opt_param-scheduler and --override-opt_param-scheduler "
                                          "are exclusive"):
        OptimizerArgs(use_checkpoint_opt_param_scheduler=True, override_opt_param_scheduler=True)


class MegatronRamp:
    """RampupBatchsizeNumMicroBatches.update and update_train_iters (megatron/microbatches.py, training.py)."""

    def __init__(self, start, increment, samples, global_batch):
        self.start, self.increment, self.ramup_samples, self.global_batch_size = start, increment, samples, global_batch
        self.rampup_samples_per_increment = samples / ((global_batch - start) // increment)

    def update(self, consumed_samples):
        if consumed_samples > self.ramup_samples:
            return self.global_batch_size
        steps = int(consumed_samples / self.rampup_samples_per_increment)
        return self.start + steps * self.increment

    def train_iters(self, train_samples):
        iterations, consumed_samples = 0, 0
        while consumed_samples <= self.ramup_samples:
            consumed_samples += self.update(consumed_samples)
            iterations += 1
        return iterations + (train_samples - consumed_samples) // self.global_batch_size


@pytest.mark.parametrize("start, increment, samples, final, train_samples", [
    (4, 4, 40, 16, 200), (16, 8, 300, 64, 1000), (8, 8, 1, 32, 100), (2, 2, 17, 8, 60)])
def test_the_batch_ramp_is_megatrons(start, increment, samples, final, train_samples):
    ramp, oracle = BatchRamp.from_flag([start, increment, samples], final, 2, 1), MegatronRamp(start, increment,
                                                                                                samples, final)
    assert [ramp.batch_at(n) for n in range(0, samples + 2 * final)] == \
        [oracle.update(n) for n in range(0, samples + 2 * final)]
    assert ramp.train_iters(train_samples) == oracle.train_iters(train_samples)


def test_a_ramp_that_starts_at_the_global_batch_is_constant():
    """Megatron divides by the ramp's increments there (none): zero-lab trains at the global batch."""
    ramp = BatchRamp.from_flag([8, 8, 30], 8, 2, 1)
    assert [ramp.batch_at(n) for n in (0, 8, 40)] == [8, 8, 8] and ramp.train_iters(50) == 6


@pytest.mark.parametrize("values, message", [
    ([0, 4, 40], "--rampup-batch-size 0 4 40: the start batch, the increment and the ramp-up samples must be >= 1"),
    ([4, 4, 0], "--rampup-batch-size 4 4 0: the start batch, the increment and the ramp-up samples must be >= 1"),
    ([4, 5, 40], "--rampup-batch-size 4 5 40: --global-batch-size 16 must be the start batch plus a whole number"),
    ([32, 4, 40], "--rampup-batch-size 32 4 40: --global-batch-size 16 must be the start batch"),
    ([2, 2, 40], "--rampup-batch-size 2 2 40: the ramp's global batch 2 is not divisible by --micro-batch-size 2 x "
                 "data-parallel size 2"),
])
def test_a_ramp_that_does_not_fit_names_the_flag(values, message):
    with pytest.raises(BatchRampError, match="^" + message.replace("(", r"\(")):
        BatchRamp.from_flag(values, 16, 2, 2)


def flags(prefix, *extra, train=("--train-iters", "10")):
    """A small model's flags (test_arguments.py's base) with `train` as its length."""
    return ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "2", *train, "--data-path", prefix, "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "1000", *extra]


def test_megatron_deepspeeds_schedule_flags_are_parsed(data_prefix):
    """Refused by argparse as unrecognized before."""
    args = parse_args(flags(data_prefix, "--lr-warmup-tokens", "1000", "--lr-decay-tokens", "9000", "--train-tokens",
                            "20000", "--exit-duration-in-mins", "0.5"), world_size=1)
    assert (args.optimizer.lr_warmup_tokens, args.optimizer.lr_decay_tokens) == (1000, 9000)
    assert (args.training.train_tokens, args.training.exit_duration_in_mins) == (20000, 0.5)
    args = parse_args(flags(data_prefix, "--global-batch-size", "16", "--rampup-batch-size", "4", "4", "100",
                            "--lr-warmup-samples", "32", "--lr-decay-samples", "200",
                            train=("--train-samples", "400")), world_size=2)
    assert args.training.rampup_batch_size == [4, 4, 100]
    assert (args.optimizer.lr_warmup_samples, args.optimizer.lr_decay_samples) == (32, 200)


@pytest.mark.parametrize("extra, train, message", [
    (["--rampup-batch-size", "4", "4", "100"], ("--train-iters", "10"),
     "--rampup-batch-size needs sample-based training: give --train-samples instead of --train-iters"),
    (["--rampup-batch-size", "4", "4"], ("--train-samples", "100"),
     "--rampup-batch-size takes three numbers: <start batch size> <batch size increment> <ramp-up samples>, "
     "got [4, 4]"),
    (["--rampup-batch-size", "2", "2", "100"], ("--train-samples", "100"),
     "--rampup-batch-size 2 2 100: the ramp's global batch 2 is not divisible by --micro-batch-size 2 x "
     "data-parallel size 2"),
    (["--lr-warmup-iters", "3"], ("--train-samples", "100"),
     "--lr-warmup-iters is iteration-based; with --train-samples give --lr-warmup-samples"),
    (["--lr-decay-iters", "3"], ("--train-samples", "100"),
     "--lr-decay-iters is iteration-based; with --train-samples give --lr-decay-samples"),
    (["--lr-decay-samples", "30"], ("--train-iters", "10"),
     "--lr-decay-samples is sample-based; with --train-iters give --lr-decay-iters"),
    (["--lr-warmup-samples", "30"], ("--train-epochs", "1"),
     "--lr-warmup-samples is sample-based; with --train-epochs give --lr-warmup-iters"),
    (["--lr-warmup-samples", "30", "--lr-warmup-fraction", "0.1"], ("--train-samples", "100"),
     "--lr-warmup-fraction and --lr-warmup-samples are exclusive; give one"),
    (["--lr-decay-tokens", "0"], ("--train-iters", "10"), "--lr-decay-tokens must be >= 1, got 0"),
    (["--train-tokens", "0"], ("--train-iters", "10"), "--train-tokens must be >= 1, got 0"),
    (["--exit-duration-in-mins", "0"], ("--train-iters", "10"), "--exit-duration-in-mins must be > 0, got 0.0"),
])
def test_bad_schedule_flags_name_the_flag(data_prefix, extra, train, message):
    with pytest.raises(ConfigError) as err:
        parse_args(flags(data_prefix, "--global-batch-size", "16", *extra, train=train), world_size=2)
    assert str(err.value) == message
