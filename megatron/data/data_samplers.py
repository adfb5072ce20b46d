"""Megatron's pretraining sampler and the training data loader.

Samples are consumed strictly in order: each step of a data-parallel group takes the next
micro_batch_size * data_parallel_size samples and rank r takes its contiguous slice. A
global batch (micro batches of all ranks and all accumulation steps) is therefore the same
run of sample ids whatever the data-parallel size, and resuming from consumed_samples
continues exactly where a run stopped.
"""
import functools
import os
import signal
import threading
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


def _end_only_at_the_ranks_sigterm(rank_pid: int, worker_id: int) -> None:
    # A SIGTERM to the whole job (PBS at walltime, Slurm) reaches the loader's workers too; one that died of it
    # would make the rank raise at its next batch instead of saving (--exit-signal-handler). So a worker ends
    # at a SIGTERM from its own rank only: the rank's exit (Python's multiprocessing terminates and then joins
    # its daemonic children) and torch's shutdown send that one, and a worker ignoring it would hang the rank's
    # exit forever. The worker starts with SIGTERM blocked (_SigtermBlockingLoader), so a signal sent before
    # this ran waits here too; a worker whose rank was killed exits on its own (torch's watchdog). rank_pid is
    # taken in the rank, not read as os.getppid(), which is the fork server's under the forkserver start method.

    def wait_for_the_ranks_sigterm() -> None:
        while signal.sigwaitinfo({signal.SIGTERM}).si_pid != rank_pid:
            pass
        os._exit(0)

    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    threading.Thread(target=wait_for_the_ranks_sigterm, name="sigterm-from-rank", daemon=True).start()


class _SigtermBlockingLoader(DataLoader):
    """Starts its workers with SIGTERM blocked (a worker inherits the mask), so none can die of one in the
    moment before its worker_init_fn runs; a SIGTERM to the rank meanwhile is delivered once they started.
    The workers are forked from the rank whatever Python's default start method: one forked by the fork server
    (the default from Python 3.14) gets the server's mask instead, and a thread it starts before worker_init_fn
    then dies of the job's SIGTERM."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, multiprocessing_context="fork", **kwargs)

    def __iter__(self):
        blocked_before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            return super().__iter__()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked_before)


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
    if num_workers == 0:
        return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate_samples, pin_memory=pin_memory)
    return _SigtermBlockingLoader(dataset, batch_sampler=sampler, num_workers=num_workers, pin_memory=pin_memory,
                                  collate_fn=collate_samples, persistent_workers=True,
                                  worker_init_fn=functools.partial(_end_only_at_the_ranks_sigterm, os.getpid()))
