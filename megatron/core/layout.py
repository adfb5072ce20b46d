"""How a world of ranks splits into tensor-, sequence- (DeepSpeed-Ulysses), pipeline- and data-parallel groups:
pure arithmetic, no torch, so that a launcher can check a layout before any rank starts (megatron/launch/plan.py);
megatron/core/parallel_state.py builds the process groups from it.

Rank order: tensor-parallel ranks are adjacent (fastest), then the sequence-parallel ranks, then data parallel,
then pipeline stages (slowest). The ranks of a stage that share a tensor rank form the sequence-data-parallel
group (SP x DP): they all hold the same parameters, so ZeRO partitions over it (as Megatron-DeepSpeed does).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megatron.errors import ZeroLabError


class ParallelLayoutError(ZeroLabError, ValueError):
    """A parallel size that cannot split the world; the message names the flag."""


@dataclass(frozen=True)
class ParallelLayout:
    world_size: int
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    # DeepSpeed-Ulysses: each rank of a group holds 1/N of every sequence (Megatron-DeepSpeed's flag)
    sequence_parallel_size: int = field(default=1, metadata=dict(
        names=("--ds-sequence-parallel-size",),
        help="DeepSpeed-Ulysses: split each sequence over this many ranks (docs/long-sequences.md)"))

    def __post_init__(self):
        for flag, value in (
            ("--tensor-model-parallel-size", self.tensor_model_parallel_size),
            ("--pipeline-model-parallel-size", self.pipeline_model_parallel_size),
            ("--ds-sequence-parallel-size", self.sequence_parallel_size),
        ):
            if value < 1:
                raise ParallelLayoutError(f"{flag} must be >= 1, got {value}")
        if self.world_size < 1:
            raise ParallelLayoutError(f"world size must be >= 1, got {self.world_size}")
        if self.world_size % self._model_and_sequence_parallel:
            sequence = (f" x --ds-sequence-parallel-size {self.sequence_parallel_size}"
                        if self.sequence_parallel_size > 1 else "")
            raise ParallelLayoutError(
                f"world size {self.world_size} is not divisible by --tensor-model-parallel-size "
                f"{self.tensor_model_parallel_size} x --pipeline-model-parallel-size "
                f"{self.pipeline_model_parallel_size}{sequence}"
            )

    @property
    def _model_and_sequence_parallel(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.sequence_parallel_size

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // self._model_and_sequence_parallel

    @property
    def _stage_size(self) -> int:
        """Ranks per pipeline stage (TP x SP x DP)."""
        return self.world_size // self.pipeline_model_parallel_size

    @property
    def _tensor_and_sequence(self) -> int:
        return self.tensor_model_parallel_size * self.sequence_parallel_size

    @property
    def logging_rank(self) -> int:
        """The rank that prints the log lines: tensor and data-parallel rank 0 of the last pipeline stage."""
        return (self.pipeline_model_parallel_size - 1) * self._stage_size

    def data_parallel_rank(self, rank: int) -> int:
        """Index of global `rank` within its data-parallel group (which data shard it reads)."""
        return (rank % self._stage_size) // self._tensor_and_sequence

    def sequence_parallel_rank(self, rank: int) -> int:
        """Index of global `rank` within its sequence-parallel group (which slice of each sequence it holds)."""
        return (rank // self.tensor_model_parallel_size) % self.sequence_parallel_size

    def tensor_groups(self) -> list[list[int]]:
        tp = self.tensor_model_parallel_size
        return [list(range(start, start + tp)) for start in range(0, self.world_size, tp)]

    def data_groups(self) -> list[list[int]]:
        """Ranks holding the same sequence slice of different samples."""
        groups = []
        for stage in range(self.pipeline_model_parallel_size):
            first = stage * self._stage_size
            for offset in range(self._tensor_and_sequence):
                groups.append(list(range(first + offset, first + self._stage_size, self._tensor_and_sequence)))
        return groups

    def sequence_groups(self) -> list[list[int]]:
        """Ranks holding the slices of the same sequences (one sample, one tensor rank, one stage)."""
        tp, groups = self.tensor_model_parallel_size, []
        for first in range(0, self.world_size, self._tensor_and_sequence):
            groups += [list(range(first + tp_rank, first + self._tensor_and_sequence, tp)) for tp_rank in range(tp)]
        return groups

    def sequence_data_groups(self) -> list[list[int]]:
        """Ranks holding the same parameters (SP x DP of one stage and tensor rank): ZeRO's partition group."""
        groups = []
        for stage in range(self.pipeline_model_parallel_size):
            first = stage * self._stage_size
            for tp_rank in range(self.tensor_model_parallel_size):
                groups.append(list(range(first + tp_rank, first + self._stage_size, self.tensor_model_parallel_size)))
        return groups

    def pipeline_groups(self) -> list[list[int]]:
        return [list(range(start, self.world_size, self._stage_size)) for start in range(self._stage_size)]

    def model_groups(self) -> list[list[int]]:
        """Ranks that together hold one full model replica (TP x PP), one group per SP x DP rank."""
        replicas = self.sequence_data_groups()
        return [[group[index] for group in replicas] for index in range(len(replicas[0]))]
