"""Megatron-DeepSpeed's legacy sequence-length curriculum (docs/curriculum.md): with --curriculum-learning-legacy
and a --deepspeed_config whose `curriculum_learning` section is enabled, step i trains on the first L(i) tokens
of each sample, L rising from min_difficulty to max_difficulty by DeepSpeed's own CurriculumScheduler.

DeepSpeed 0.19 no longer runs this curriculum in its engine (its config refuses the top-level
`curriculum_learning` key), so the section is read here, taken out of the config DeepSpeed gets
(megatron/deepspeed_config.py), and the loop asks the scheduler for each step's length as Megatron-DeepSpeed's
loop does: update_difficulty(iteration + 1). fixed_linear is a function of that step alone, so a run resumed at
the checkpoint's iteration continues the schedule.
"""
from __future__ import annotations

from dataclasses import dataclass

from deepspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler

from megatron.errors import ZeroLabError

SECTION = "curriculum_learning"
FLAG = "--curriculum-learning-legacy"


class CurriculumError(ZeroLabError, ValueError):
    """A curriculum_learning section (or its flag) that cannot run; the message names the key or flag."""


@dataclass(frozen=True)
class CurriculumConfig:
    """The fixed_linear seqlen schedule, as the section gives it (DeepSpeed's key names)."""
    min_difficulty: int
    max_difficulty: int
    total_curriculum_step: int
    difficulty_step: int

    def scheduler_config(self) -> dict:
        """The section in the form DeepSpeed's CurriculumScheduler takes."""
        return {"curriculum_type": "seqlen", "min_difficulty": self.min_difficulty,
                "max_difficulty": self.max_difficulty, "schedule_type": "fixed_linear",
                "schedule_config": {"total_curriculum_step": self.total_curriculum_step,
                                    "difficulty_step": self.difficulty_step}}


def _count(section: dict, where: str, key: str, name: str) -> int:
    value = section.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise CurriculumError(f"{where}: {name} must be an integer >= 1, got {value!r}")
    return value


def _checked_section(section, where: str) -> CurriculumConfig:
    """The section's values, each an integer >= 1, the types the one supported ones."""
    if not isinstance(section, dict):
        raise CurriculumError(f"{where}: {SECTION} must be a JSON object, got {section!r}")
    for key, supported in (("curriculum_type", "seqlen"), ("schedule_type", "fixed_linear")):
        if section.get(key) != supported:
            raise CurriculumError(f"{where}: {SECTION}.{key} must be {supported!r} (the legacy curriculum zero-lab "
                                  f"runs), got {section.get(key)!r}")
    schedule = section.get("schedule_config")
    if not isinstance(schedule, dict):
        raise CurriculumError(f"{where}: {SECTION}.schedule_config must be an object with total_curriculum_step "
                              f"and difficulty_step, got {schedule!r}")
    return CurriculumConfig(
        *(_count(section, where, key, f"{SECTION}.{key}") for key in ("min_difficulty", "max_difficulty")),
        *(_count(schedule, where, key, f"{SECTION}.schedule_config.{key}")
          for key in ("total_curriculum_step", "difficulty_step")))


def _check_lengths(config: CurriculumConfig, where: str, seq_length: int) -> None:
    low, high, step = config.min_difficulty, config.max_difficulty, config.difficulty_step
    if low > high:
        raise CurriculumError(f"{where}: {SECTION}.min_difficulty {low} is larger than max_difficulty {high}")
    if high > seq_length:
        raise CurriculumError(f"{where}: {SECTION}.max_difficulty {high} is longer than --seq-length {seq_length} "
                              "(the samples' length)")
    for key, value in (("min_difficulty", low), ("max_difficulty", high)):
        # DeepSpeed rounds every length down to a multiple of the step (a min_difficulty that is not one is
        # never trained at, a max_difficulty that is not one is reached only by its cap)
        if value % step:
            raise CurriculumError(f"{where}: {SECTION}.schedule_config.difficulty_step {step} does not divide "
                                  f"{key} {value}; every length is a multiple of it")


def read_curriculum(user_config: dict | None, path: str | None, flag_given: bool,
                    seq_length: int) -> CurriculumConfig | None:
    """The curriculum the --deepspeed_config JSON asks for, or None. As in Megatron-DeepSpeed, which has no flag for
    it, the JSON's curriculum_learning section with "enabled": true turns it on (its scripts pass only the JSON);
    zero-lab's flag asks for it too, and is refused where the JSON does not enable it."""
    section = (user_config or {}).get(SECTION)
    enabled = isinstance(section, dict) and section.get("enabled") is True
    where = f"--deepspeed_config {path}"
    if flag_given and not enabled:
        if path is None:
            got = "no --deepspeed_config"
        elif not isinstance(section, dict):
            got = f"it has no {SECTION} section" if section is None else f"its {SECTION} is {section!r}"
        else:
            got = f"its {SECTION}.enabled is {section.get('enabled')!r}"
        raise CurriculumError(f"{FLAG} needs a --deepspeed_config JSON whose {SECTION} section has \"enabled\": true "
                              f"({got}; docs/curriculum.md)")
    if not enabled:
        return None
    config = _checked_section(section, where)
    _check_lengths(config, where, seq_length)
    return config


class SeqlenCurriculum:
    """The run's schedule: DeepSpeed's CurriculumScheduler, asked once per step, and the training batches cut to
    the current length."""

    def __init__(self, config: CurriculumConfig):
        self.scheduler = CurriculumScheduler(config.scheduler_config())
        self.seq_length = config.min_difficulty

    def update(self, step: int) -> int:
        """The length of global step `step` (1 for the first), which the batches read from now on are cut to."""
        self.seq_length = self.scheduler.update_difficulty(step)
        return self.seq_length

    def truncating(self, batches):
        """The batches of `batches` cut to the first seq_length + 1 tokens (inputs and the labels one token on):
        Megatron-DeepSpeed cuts tokens, labels, loss mask and positions to the first curriculum_seqlen, the same."""
        for batch in batches:
            yield {**batch, "text": batch["text"][:, :self.seq_length + 1]}
