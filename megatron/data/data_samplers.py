"""Megatron's pretraining sampler and the training data loader.

Samples are consumed strictly in order: each step of a data-parallel group takes the next
micro_batch_size * data_parallel_size samples and rank r takes its contiguous slice. A
global batch (micro batches of all ranks and all accumulation steps) is therefore the same
run of sample ids whatever the data-parallel size, and resuming from consumed_samples
continues exactly where a run stopped.
"""
import signal
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader

from megatron.data.dataset_utils import DatasetError


class MegatronPretrainingSampler:
    """Yields this rank's micro batches of sample ids, from consumed_samples to the end
    (an incomplete last step is dropped, so all ranks yield the same number of batches)."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int):
        if total_samples <= 0:
            raise DatasetError(f"the dataset has no samples ({total_samples})")
        if micro_batch_size <= 0:
            raise DatasetError(f"--micro-batch-size {micro_batch_size}: expected a positive number")
        if data_parallel_size <= 0 or not 0 <= data_parallel_rank < data_parallel_size:
            raise DatasetError(f"data-parallel rank {data_parallel_rank} is not in a group of size {data_parallel_size}")
        # Equal is allowed: a finished run that is started again simply gets no batches.
        if not 0 <= consumed_samples <= total_samples:
            raise DatasetError(f"consumed samples {consumed_samples}: the dataset has only {total_samples} samples "
                               "(resume with at least as many training samples as already consumed)")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.step_size = micro_batch_size * data_parallel_size

    def __len__(self) -> int:
        return (self.total_samples - self.consumed_samples) // self.step_size

    def __iter__(self) -> Iterator[list[int]]:
        first = self.data_parallel_rank * self.micro_batch_size
        for step_start in range(self.consumed_samples, self.total_samples - self.step_size + 1, self.step_size):
            start = step_start + first
            yield list(range(start, start + self.micro_batch_size))


def collate_samples(samples: list[dict]) -> dict[str, torch.Tensor]:
    return {"text": torch.stack([torch.as_tensor(sample["text"], dtype=torch.int64) for sample in samples])}


def _ignore_sigterm(worker_id: int) -> None:
    # A SIGTERM to the job's process group (PBS at walltime, Slurm) reaches the loader's workers too; one
    # that died of it would make the rank raise at its next batch instead of saving (--exit-signal-handler).
    # The rank ends its workers itself when it exits, and a worker whose rank is gone exits on its own.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def loader_workers(num_workers: int | None, on_cuda: bool) -> int:
    """--num-workers, else 2 on CUDA (Megatron's default: batches are read while the GPU computes) and 0 on CPU
    ranks, where workers compete with the ranks for the cores (bench/bench_host_work.py)."""
    if num_workers is not None:
        return num_workers
    return 2 if on_cuda else 0


def build_pretraining_data_loader(dataset, consumed_samples: int, micro_batch_size: int,
                                  data_parallel_rank: int, data_parallel_size: int,
                                  num_workers: int = 0, pin_memory: bool = False) -> DataLoader | None:
    """Batches {"text": LongTensor [micro_batch_size, seq_length + 1]} for this rank, or None
    without a dataset (a split with no samples requested). num_workers > 0 (--num-workers) reads the
    samples in that many worker processes, ahead of the step and in the sampler's order; pin_memory
    (on CUDA) lets the batch's copy to the GPU run without blocking the host."""
    if dataset is None:
        return None
    sampler = MegatronPretrainingSampler(len(dataset), consumed_samples, micro_batch_size,
                                         data_parallel_rank, data_parallel_size)
    return DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers, pin_memory=pin_memory,
                      collate_fn=collate_samples, persistent_workers=num_workers > 0,
                      worker_init_fn=_ignore_sigterm if num_workers > 0 else None)
