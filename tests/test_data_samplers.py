"""Pretraining sampler and data loader: the same global batches for any data-parallel size
and accumulation, exact resume from consumed_samples, and (with real gloo ranks under
torchrun) the index cache built once by local rank 0 while the other rank waits.

This file is also the torchrun worker of the multi-rank tests (see `__main__` below)."""
import glob
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from megatron.data.data_samplers import MegatronPretrainingSampler, build_pretraining_data_loader
from megatron.data.dataset_utils import DatasetError
from megatron.data.gpt_dataset import build_train_valid_test_datasets
from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder

SEQ_LENGTH = 8


def write_corpus(prefix, num_docs=30, seed=3):
    builder = MMapIndexedDatasetBuilder(f"{prefix}.bin", np.int32)
    for doc, size in enumerate(np.random.default_rng(seed).integers(4, 40, size=num_docs)):
        builder.add_item(np.arange(size) + doc * 1000)
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


@pytest.fixture
def train_dataset(tmp_path):
    prefix = write_corpus(tmp_path / "corpus")
    train, _, _ = build_train_valid_test_datasets([prefix], "1", (96, 0, 0), SEQ_LENGTH, 1234)
    return train


def global_batches(dataset, micro_batch, dp_size, grad_accumulation, num_steps, consumed=0):
    """Per optimizer step, the token rows every rank saw in all its micro batches, sorted."""
    loaders = [iter(build_pretraining_data_loader(dataset, consumed, micro_batch, rank, dp_size))
               for rank in range(dp_size)]
    steps = []
    for _ in range(num_steps):
        rows = []
        for _ in range(grad_accumulation):
            for loader in loaders:
                batch = next(loader)["text"]
                assert batch.dtype == torch.int64 and batch.shape == (micro_batch, SEQ_LENGTH + 1)
                rows.extend(tuple(row) for row in batch.tolist())
        steps.append(sorted(rows))
    return steps


def test_global_batches_do_not_depend_on_data_parallel_size(train_dataset):
    # Global batch 8 as DP=1 x GAS=2 x mbs 4, DP=2 x GAS=1 x mbs 4, DP=4 x GAS=1 x mbs 2, DP=2 x GAS=2 x mbs 2.
    reference = global_batches(train_dataset, 4, 1, 2, num_steps=5)
    assert reference == global_batches(train_dataset, 4, 2, 1, num_steps=5)
    assert reference == global_batches(train_dataset, 2, 4, 1, num_steps=5)
    assert reference == global_batches(train_dataset, 2, 2, 2, num_steps=5)
    expected = [sorted(tuple(train_dataset[i]["text"].tolist()) for i in range(8 * s, 8 * s + 8)) for s in range(5)]
    assert reference == expected
    assert len({row for step in reference for row in step}) == 40  # no sample repeated


def test_worker_processes_give_the_same_batches(train_dataset):
    def batches(num_workers):
        loader = build_pretraining_data_loader(train_dataset, 16, 4, 1, 2, num_workers=num_workers)
        return [batch["text"] for batch in loader]

    serial, parallel = batches(0), batches(2)
    assert len(serial) == len(parallel) == (len(train_dataset) - 16) // 8
    for a, b in zip(serial, parallel):
        assert torch.equal(a, b)


# A rank whose loader workers start by `method`: SIGTERM from the rank to its worker, as the rank's exit sends it.
SIGTERM_FROM_THE_RANK = """
import multiprocessing, os, signal, subprocess, sys
from megatron.data.data_samplers import build_pretraining_data_loader
from megatron.data.gpt_dataset import build_train_valid_test_datasets
if __name__ == "__main__":
    multiprocessing.set_start_method(sys.argv[2])
    train, _, _ = build_train_valid_test_datasets([sys.argv[1]], "1", (96, 0, 0), 8, 1234)
    batches = iter(build_pretraining_data_loader(train, 0, 4, 0, 1, num_workers=1))
    next(batches)
    [worker] = batches._workers
    subprocess.run(["kill", "-TERM", str(worker.pid)], check=True)  # the job's SIGTERM, from another process
    worker.join(timeout=2)
    print("worker alive after the job's SIGTERM:", worker.is_alive())
    os.kill(worker.pid, signal.SIGTERM)
    worker.join(timeout=20)
    print("worker exit code:", worker.exitcode)
    os._exit(0)
"""


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn"])  # forkserver: Python 3.14's default on Linux
def test_a_loader_worker_ends_at_its_ranks_sigterm_under_every_start_method(tmp_path, method):
    """A worker outlives the job's SIGTERM (the rank saves first) and ends at its rank's (the rank exiting), told
    apart by the sender's pid. Under forkserver its parent is the fork server, not the rank, and it starts with the
    server's signal mask: the loader forks its workers from the rank whatever the default."""
    prefix = write_corpus(tmp_path / "corpus")
    result = subprocess.run([sys.executable, "-c", SIGTERM_FROM_THE_RANK, prefix, method], capture_output=True,
                            text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-2:] == ["worker alive after the job's SIGTERM: True", "worker exit code: 0"], \
        result.stdout + result.stderr[-3000:]


def test_ranks_take_contiguous_slices_of_each_step():
    batches = [list(MegatronPretrainingSampler(26, 0, 3, rank, 2)) for rank in range(2)]
    assert batches[0] == [[0, 1, 2], [6, 7, 8], [12, 13, 14], [18, 19, 20]]
    assert batches[1] == [[3, 4, 5], [9, 10, 11], [15, 16, 17], [21, 22, 23]]  # 24, 25: incomplete step dropped
    assert len(MegatronPretrainingSampler(26, 0, 3, 1, 2)) == 4


def test_resume_from_consumed_samples_continues_the_sequence(train_dataset):
    full = global_batches(train_dataset, 2, 2, 2, num_steps=6)
    resumed = global_batches(train_dataset, 2, 2, 2, num_steps=3, consumed=3 * 8)
    assert resumed == full[3:]
    # A resumed run may even change its data-parallel layout and still see the same data.
    assert global_batches(train_dataset, 4, 1, 2, num_steps=3, consumed=3 * 8) == full[3:]


@pytest.mark.parametrize("args,message", [
    ((10, 11, 2, 0, 1), r"consumed samples 11: the dataset has only 10 samples"),
    ((10, -1, 2, 0, 1), r"consumed samples -1"),
    ((10, 0, 0, 0, 1), r"--micro-batch-size 0"),
    ((10, 0, 2, 2, 2), r"data-parallel rank 2 is not in a group of size 2"),
    ((0, 0, 2, 0, 1), r"the dataset has no samples"),
])
def test_sampler_rejects_bad_arguments(args, message):
    with pytest.raises(DatasetError, match=message):
        MegatronPretrainingSampler(*args)


def test_fully_consumed_dataset_yields_no_batches():
    assert list(MegatronPretrainingSampler(10, 10, 2, 0, 1)) == []
    assert list(MegatronPretrainingSampler(10, 9, 2, 0, 1)) == []  # one sample left: no full step


def test_loader_without_dataset_is_none():
    assert build_pretraining_data_loader(None, 0, 4, 0, 1) is None


def run_torchrun(tmp_path, mode):
    from conftest import REPO_ROOT, test_env
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(REPO_ROOT / "tests" / "test_data_samplers.py"), mode, str(tmp_path)],
        env=test_env(), capture_output=True, text=True, timeout=300)
    return result


@pytest.mark.slow
def test_two_ranks_build_the_index_cache_once(tmp_path):
    write_corpus(tmp_path / "corpus")
    result = run_torchrun(tmp_path, "build")
    assert result.returncode == 0, result.stdout + result.stderr
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    # Only local rank 0 wrote the cache; rank 1 found it complete after the barrier.
    assert reports[0]["existed_before"] is False and reports[0]["built"] is True
    assert reports[1]["built"] is False
    assert reports[0]["files"] == reports[1]["files"] and len(reports[0]["files"]) == 3
    assert reports[0]["first_batch"] != reports[1]["first_batch"]  # each rank its own slice
    assert result.stdout.count(" > building train indices") == 1


@pytest.mark.slow
def test_failed_build_on_local_rank_zero_releases_the_other_rank(tmp_path):
    result = run_torchrun(tmp_path, "fail")
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "rank0.txt").read_text() == "RuntimeError: disk full on local rank 0"
    assert (tmp_path / "rank1.txt").read_text() == (
        "DatasetError: building the test cache failed on a local rank 0; see that rank's error")


def worker(mode, folder):
    """torchrun worker: 2 gloo ranks on one node (LOCAL_RANK 0 and 1)."""
    import torch.distributed as dist

    from megatron.data import gpt_dataset
    from megatron.data.dataset_utils import build_on_local_rank_zero

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if mode == "fail":
        def build():
            if int(os.environ["LOCAL_RANK"]) == 0:
                raise RuntimeError("disk full on local rank 0")
        try:
            build_on_local_rank_zero(build, "the test cache")
            outcome = "returned"
        except Exception as exc:  # recorded for the test: both ranks must get here
            outcome = f"{type(exc).__name__}: {exc}"
        with open(os.path.join(folder, f"rank{rank}.txt"), "w") as handle:
            handle.write(outcome)
        dist.destroy_process_group()
        return

    pattern = os.path.join(folder, "corpus_train_indexmap_*.npy")
    existed_before = bool(glob.glob(pattern))
    built = []
    original = gpt_dataset.build_index_arrays

    def slow_build(*args):
        built.append(True)
        time.sleep(1.0)  # a rank that did not wait would find no cache and build it too
        return original(*args)

    gpt_dataset.build_index_arrays = slow_build
    train, _, _ = gpt_dataset.build_train_valid_test_datasets(
        [os.path.join(folder, "corpus")], "1", (64, 0, 0), SEQ_LENGTH, 1234)
    loader = build_pretraining_data_loader(train, 0, 2, rank, 2)
    report = {
        "existed_before": existed_before,
        "built": bool(built),
        "files": {path: os.stat(path).st_ino for path in sorted(glob.glob(pattern))},
        "first_batch": next(iter(loader))["text"].tolist(),
    }
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as handle:
        json.dump(report, handle)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2])
