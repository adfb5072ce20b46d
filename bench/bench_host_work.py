"""The host's work between training steps: this loop against the per-step behaviour it replaced, in one run.

Both sides run the real loop (megatron.training.train) with the real DeepSpeed engine, the real data loader
over a GPT dataset on disk, --exit-signal-handler and logging every --log-interval steps:

  before: the data loaded on the training thread (--num-workers 0), the loss all-reduced and read with
          .item() after every step, a device synchronize before and after every step, the exit flag
          all-reduced and read after every step (the old step and poll replayed around the same loop);
  ours:   the default loader workers (2 on CUDA, 0 on CPU ranks; --ours-workers N), the losses read once
          per log interval, synchronize only around the bookkeeping iterations, the exit flag read every
          min(--log-interval, 10) steps.

Runs go ours, before, before, ours (machine-load drift favours neither); printed per side: seconds per
iteration (median of its two runs), milliseconds the loop waited for a batch (median over the steps after
the first; the first batch, which waits for the workers to start, apart), and the host reads (.item()/.tolist() by megatron/ code, exit polls) per step. On CPU a synchronize is free and a
read waits for nothing, so there the difference is the loader wait and the collectives; on a GPU each
read and synchronize also drains the queue of launched kernels.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 bench/bench_host_work.py
"""
import argparse
import contextlib
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # pretrain_gpt.py, in the repository root

import megatron.training as training  # noqa: E402
from common import counting_host_reads, start_ranks  # noqa: E402
from megatron.accounting.report import build_reporter  # noqa: E402
from megatron.arguments import parse_args  # noqa: E402
from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder  # noqa: E402
from megatron.engine import setup_engine  # noqa: E402
from megatron.exit_signal import ExitSignalHandler  # noqa: E402
from megatron.initialize import set_seed  # noqa: E402
from megatron.model import GPTModel  # noqa: E402
from megatron.loop_state import LoopState, Schedule  # noqa: E402
from megatron import accounting  # noqa: E402
from megatron.startup import prepare_run  # noqa: E402
from pretrain_gpt import build_data_iterators  # noqa: E402

VOCAB = 50257
MEGATRON = str(Path(__file__).resolve().parent.parent / "megatron")


def options(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--ours-workers", type=int, default=None,
                        help="--num-workers of our side (default: pretrain_gpt.py's, 2 on CUDA and 0 on CPU ranks)")
    parser.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher")
    return parser.parse_args(argv)


def toy_dataset(folder: Path) -> str:
    prefix = str(folder / "bench_text_document")
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", np.uint16)
    generator = np.random.default_rng(0)
    for _ in range(2000):
        builder.add_item(generator.integers(0, VOCAB, size=int(generator.integers(50, 400))))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


class TimedBatches:
    """The train iterator, timing how long each next() kept the loop waiting."""

    def __init__(self, source):
        self.source, self.waits = source, []

    def __iter__(self):
        return self

    def __next__(self):
        start = time.perf_counter()
        batch = next(self.source)
        self.waits.append(time.perf_counter() - start)
        return batch


def before_step(engine, data_iterator, args, dist_info, eod, probe_memory=False):
    """train_step with the per-step host work it had before: synchronize around it, the loss read at once."""
    training._synchronize(dist_info)
    result = training.train_step(engine, data_iterator, args, dist_info, eod, probe_memory=probe_memory)
    training._synchronize(dist_info)
    result.loss = training.data_parallel_mean(result.loss, dist_info)  # all-reduce and .item()
    return result


@contextlib.contextmanager
def counting_reads(counts: dict):
    """Count .item()/.tolist() made by megatron/ code and the exit-flag polls."""
    poll = ExitSignalHandler.stop_requested
    reads = {}

    def counted_poll(handler, device):
        counts["polls"] += 1
        return poll(handler, device)
    ExitSignalHandler.stop_requested = counted_poll
    try:
        with counting_host_reads(reads, (MEGATRON,), (("item", "tolist"), ())):
            yield
    finally:
        counts["reads"] += sum(reads.values())
        ExitSignalHandler.stop_requested = poll


def one_run(side: str, opts, prefix: str, dist_info) -> dict:
    from deepspeed.accelerator import get_accelerator

    world = dist_info.world_size
    argv = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4",
            "--seq-length", str(opts.seq_length), "--max-position-embeddings", str(opts.seq_length),
            "--micro-batch-size", str(opts.micro_batch_size), "--global-batch-size", str(opts.micro_batch_size * world),
            "--train-iters", str(opts.iters), "--log-interval", str(opts.log_interval), "--eval-iters", "0",
            "--zero-stage", "1", "--data-path", prefix, "--tokenizer-type", "NullTokenizer", "--vocab-size",
            str(VOCAB), "--lr", "1e-4", "--exit-signal-handler"]
    if side == "before" or opts.ours_workers is not None:
        argv += ["--num-workers", "0" if side == "before" else str(opts.ours_workers)]
    args, _ = prepare_run(parse_args(argv, world, get_accelerator().device_name()), verbose=False)
    set_seed(1234)
    engine, ds_config = setup_engine(lambda: GPTModel(args.model), accounting.count_parameters(args.model), args,
                                     dist_info, opts.iters)
    schedule = Schedule(train_iters=opts.iters, iters_per_epoch=10**9, samples_per_epoch=10**9,
                        global_batch_size=args.training.global_batch_size)
    counts = {"reads": 0, "polls": 0}
    with contextlib.redirect_stdout(io.StringIO()) as log:
        reporter = build_reporter(args, dist_info, schedule, ds_config, training.trainer_steps())
        train_iter, _ = build_data_iterators(args, dist_info, opts.iters, 0, 0)
        batches = TimedBatches(train_iter)
        poll_steps = training.EXIT_SIGNAL_POLL_STEPS
        training.EXIT_SIGNAL_POLL_STEPS = 1 if side == "before" else poll_steps
        try:
            torch.distributed.barrier()
            start = time.perf_counter()
            with counting_reads(counts):
                state = training.train(engine, batches, None, args, dist_info, reporter, VOCAB - 1,
                                       LoopState(), step_fn=before_step if side == "before" else
                                       training.train_step)
            seconds = time.perf_counter() - start
        finally:
            training.EXIT_SIGNAL_POLL_STEPS = poll_steps
    signal_default()
    losses = [line.split("lm loss: ")[1].split()[0] for line in log.getvalue().splitlines() if "lm loss: " in line]
    engine.destroy()
    return dict(seconds=seconds / state.iteration, wait_ms=1000 * statistics.median(batches.waits[1:]),
                first_ms=1000 * batches.waits[0],
                reads=counts["reads"] / state.iteration, polls=counts["polls"] / state.iteration, losses=losses)


def signal_default():
    import signal
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def main(argv) -> int:
    opts = options(argv)
    torch.set_num_threads(1)
    dist_info = start_ranks()
    runs = {"ours": [], "before": []}
    with tempfile.TemporaryDirectory() as tmp:
        folder = [tmp]
        torch.distributed.broadcast_object_list(folder)  # one dataset (and index cache) for the ranks of a host
        if dist_info.rank == 0:
            prefix = toy_dataset(Path(folder[0]))
        torch.distributed.barrier()
        prefix = str(Path(folder[0]) / "bench_text_document")
        for side in ("ours", "before", "before", "ours"):
            runs[side].append(one_run(side, opts, prefix, dist_info))
        torch.distributed.barrier()
    if dist_info.rank == 0:
        print(f"GPT L=2 h=128 s={opts.seq_length} micro={opts.micro_batch_size} ranks={dist_info.world_size} "
              f"device={dist_info.device.type} iters={opts.iters} log-interval={opts.log_interval} "
              f"threads/rank={torch.get_num_threads()}")
        print("| side | s/iter (median of 2 runs) | loader wait ms/step (median) | first batch ms | host reads/step "
              "| exit polls/step |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for side in ("before", "ours"):
            r = runs[side]
            print(f"| {side} | {statistics.median(x['seconds'] for x in r):.4f} | "
                  f"{statistics.median(x['wait_ms'] for x in r):.2f} | "
                  f"{statistics.median(x['first_ms'] for x in r):.1f} | "
                  f"{r[0]['reads']:.2f} | {r[0]['polls']:.2f} |")
        before = statistics.median(x["seconds"] for x in runs["before"])
        ours = statistics.median(x["seconds"] for x in runs["ours"])
        print(f"ours / before time per iteration: {ours / before:.3f}")
        same = all(run["losses"] == runs["ours"][0]["losses"] for side in runs.values() for run in side)
        print(f"logged losses identical in all 4 runs: {same} ({len(runs['ours'][0]['losses'])} log lines)")
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
