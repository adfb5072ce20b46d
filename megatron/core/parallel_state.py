"""The parallel layout (tensor x sequence x pipeline x data) and the process groups it implies.

One `ParallelLayout` describes the sizes; `ParallelState.build` turns it into real
torch.distributed groups and doubles as the `mpu` object DeepSpeed expects, so that
ZeRO partitions over data-parallel ranks only. Nothing here is a module global: the
training script builds one `ParallelState` and passes it down.

Rank order follows Megatron: tensor-parallel ranks are adjacent (fastest), then data
parallel, then pipeline stages (slowest). For world 8, TP=2, PP=2:
tensor groups [0,1] [2,3] [4,5] [6,7]; data groups [0,2] [1,3] [4,6] [5,7];
pipeline groups [0,4] [1,5] [2,6] [3,7]; model-parallel groups [0,1,4,5] [2,3,6,7].
DeepSpeed-Ulysses' sequence-parallel ranks come between tensor and data parallel (megatron/core/layout.py); with
them DeepSpeed partitions ZeRO over the sequence-data-parallel group and averages gradients over its data-parallel
part, reading the get_sequence_* methods below, as it does with Megatron-DeepSpeed's mpu.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial

import torch.distributed as dist

from megatron.core.layout import ParallelLayout, ParallelLayoutError  # noqa: F401 (re-exported)


@dataclass
class _Group:
    ranks: list[int]
    rank: int
    handle: object | None  # a torch.distributed ProcessGroup, or None when not distributed

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass
class ParallelState:
    """This rank's place in the layout, with its process groups; also DeepSpeed's `mpu`."""

    layout: ParallelLayout
    rank: int
    tensor: _Group = field(repr=False)
    data: _Group = field(repr=False)
    pipeline: _Group = field(repr=False)
    model: _Group = field(repr=False)
    sequence: _Group = field(repr=False)
    sequence_data: _Group = field(repr=False)  # SP x DP: the ranks holding the same parameters

    @classmethod
    def build(cls, layout: ParallelLayout, timeout: timedelta | None = None) -> "ParallelState":
        """Create every group of the layout. With torch.distributed initialized all ranks must
        call this (new_group is collective, even for groups a rank is not in); without it the
        layout must be a single process and the groups are None (layers then run serially).
        timeout: how long a collective of these groups may wait (torch's new groups do not take the
        default group's: they would wait its 30-minute default for a lost rank)."""
        if dist.is_available() and dist.is_initialized():
            if dist.get_world_size() != layout.world_size:
                raise ParallelLayoutError(
                    f"layout is for world size {layout.world_size} but torch.distributed has {dist.get_world_size()}"
                )
            rank = dist.get_rank()
            make_group = partial(dist.new_group, timeout=timeout)
        elif layout.world_size == 1:
            rank = 0
            make_group = None
        else:
            raise ParallelLayoutError(f"world size {layout.world_size} needs torch.distributed to be initialized")
        groups = {}
        kinds = [("tensor", layout.tensor_groups()), ("data", layout.data_groups()),
                 ("pipeline", layout.pipeline_groups()), ("model", layout.model_groups())]
        if layout.sequence_parallel_size > 1:  # else no new groups: a run without Ulysses builds what it did
            kinds += [("sequence", layout.sequence_groups()), ("sequence_data", layout.sequence_data_groups())]
        for name, all_groups in kinds:
            for ranks in all_groups:
                handle = make_group(ranks) if make_group else None
                if rank in ranks:
                    groups[name] = _Group(ranks, ranks.index(rank), handle)
        groups.setdefault("sequence", _Group([rank], 0, None))
        groups.setdefault("sequence_data", groups["data"])
        return cls(layout=layout, rank=rank, **groups)

    # --- the mpu interface DeepSpeed queries (deepspeed/utils/bwc.py, zero/*) ---
    def get_tensor_model_parallel_rank(self) -> int:
        return self.tensor.rank

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.tensor.size

    def get_tensor_model_parallel_group(self):
        return self.tensor.handle

    def get_tensor_model_parallel_src_rank(self) -> int:
        """Global rank of the first rank of this rank's tensor group (broadcast source)."""
        return self.tensor.ranks[0]

    def get_data_parallel_rank(self) -> int:
        return self.data.rank

    def get_data_parallel_world_size(self) -> int:
        return self.data.size

    def get_data_parallel_group(self):
        return self.data.handle

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self.data.ranks)

    def get_sequence_parallel_rank(self) -> int:
        return self.sequence.rank

    def get_sequence_parallel_world_size(self) -> int:
        return self.sequence.size

    def get_sequence_parallel_group(self):
        return self.sequence.handle

    def get_sequence_data_parallel_rank(self) -> int:
        return self.sequence_data.rank

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.sequence_data.size

    def get_sequence_data_parallel_group(self):
        return self.sequence_data.handle

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.pipeline.rank

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.pipeline.size

    def get_pipeline_model_parallel_group(self):
        return self.pipeline.handle

    # DeepSpeed's pipeline naming of the same three.
    get_pipe_parallel_rank = get_pipeline_model_parallel_rank
    get_pipe_parallel_world_size = get_pipeline_model_parallel_world_size
    get_pipe_parallel_group = get_pipeline_model_parallel_group

    def get_model_parallel_rank(self) -> int:
        return self.model.rank

    def get_model_parallel_world_size(self) -> int:
        return self.model.size

    def get_model_parallel_group(self):
        return self.model.handle

    def is_pipeline_first_stage(self) -> bool:
        return self.pipeline.rank == 0

    def is_pipeline_last_stage(self) -> bool:
        return self.pipeline.rank == self.pipeline.size - 1
