"""How a world of ranks splits into tensor-, pipeline- and data-parallel groups: pure arithmetic, no torch, so
that a launcher can check a layout before any rank starts (megatron/launch/plan.py); megatron/core/parallel_state.py
builds the process groups from it."""
from __future__ import annotations

from dataclasses import dataclass

from megatron.errors import ZeroLabError


class ParallelLayoutError(ZeroLabError, ValueError):
    """A parallel size that cannot split the world; the message names the flag."""


@dataclass(frozen=True)
class ParallelLayout:
    world_size: int
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1

    def __post_init__(self):
        for flag, value in (
            ("--tensor-model-parallel-size", self.tensor_model_parallel_size),
            ("--pipeline-model-parallel-size", self.pipeline_model_parallel_size),
        ):
            if value < 1:
                raise ParallelLayoutError(f"{flag} must be >= 1, got {value}")
        if self.world_size < 1:
            raise ParallelLayoutError(f"world size must be >= 1, got {self.world_size}")
        model_parallel = self.tensor_model_parallel_size * self.pipeline_model_parallel_size
        if self.world_size % model_parallel:
            raise ParallelLayoutError(
                f"world size {self.world_size} is not divisible by --tensor-model-parallel-size "
                f"{self.tensor_model_parallel_size} x --pipeline-model-parallel-size "
                f"{self.pipeline_model_parallel_size}"
            )

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // (self.tensor_model_parallel_size * self.pipeline_model_parallel_size)

    @property
    def _stage_size(self) -> int:
        """Ranks per pipeline stage (TP x DP)."""
        return self.world_size // self.pipeline_model_parallel_size

    @property
    def logging_rank(self) -> int:
        """The rank that prints the log lines: tensor and data-parallel rank 0 of the last pipeline stage."""
        return (self.pipeline_model_parallel_size - 1) * self._stage_size

    def data_parallel_rank(self, rank: int) -> int:
        """Index of global `rank` within its data-parallel group (which data shard it reads)."""
        return (rank % self._stage_size) // self.tensor_model_parallel_size

    def tensor_groups(self) -> list[list[int]]:
        tp = self.tensor_model_parallel_size
        return [list(range(start, start + tp)) for start in range(0, self.world_size, tp)]

    def data_groups(self) -> list[list[int]]:
        groups = []
        for stage in range(self.pipeline_model_parallel_size):
            first = stage * self._stage_size
            for tp_rank in range(self.tensor_model_parallel_size):
                groups.append(list(range(first + tp_rank, first + self._stage_size, self.tensor_model_parallel_size)))
        return groups

    def pipeline_groups(self) -> list[list[int]]:
        return [list(range(start, self.world_size, self._stage_size)) for start in range(self._stage_size)]

    def model_groups(self) -> list[list[int]]:
        """Ranks that together hold one full model replica (TP x PP), one group per DP rank."""
        data_groups = self.data_groups()
        return [[group[dp_rank] for group in data_groups] for dp_rank in range(self.data_parallel_size)]
