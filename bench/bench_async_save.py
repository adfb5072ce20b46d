"""What a checkpoint save stalls training for, synchronous against --async-save (megatron/checkpointing/async_save.py),
at each ZeRO stage, on the real DeepSpeed engine (setup_engine, train_step, save_checkpoint).

Per round and mode, on one engine: a few steps without a save (the step time), then a save: the synchronous save's
whole write (save_checkpoint until its commit's barrier), or the asynchronous save's stall (save_checkpoint until it
hands the host copy to the writer thread), then steps while the writer runs (their time against the step time is
what the background write costs the steps sharing its CPU), then the wait for the commit. The modes take turns round by
round, in alternating order, each save under a new tag (the one before removed outside the timing).

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 bench/bench_async_save.py --stages 1,3
"""
import os
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from common import VOCAB, flags, random_batches, toy_dataset, training_bench_parser
from megatron import accounting
from megatron.arguments import parse_args
from megatron.checkpointing import protocol
from megatron.checkpointing.async_save import HostCopyEngine, finish, save_in_background
from megatron.checkpointing.save_load import save_checkpoint
from megatron.checkpointing.writer import FlushingCheckpointEngine
from megatron.initialize import DistInfo, initialize_distributed, set_seed, silence_known_warnings
from megatron.model import GPTModel
from megatron.startup import prepare_run
from megatron.engine import setup_engine
from megatron.training import train_step

MODES = ("sync", "async")
STEPS_BETWEEN = 3  # steps timed before each save, and (async) after it while the writer runs


def bench_options(argv):
    parser = training_bench_parser(__doc__, "1,3", 4, "timed saves per mode")
    parser.set_defaults(num_layers=4, hidden_size=512, num_attention_heads=8, seq_length=128, micro_batch_size=4,
                        gradient_accumulation=1, warmup=1)
    opts = parser.parse_args(argv)
    opts.compile = False  # common.flags reads it
    return opts


def measure(args, opts, dist_info: DistInfo) -> dict:
    """Per mode: the step times, each save's blocking seconds, (async) the steps during the write and the wait for
    the commit after them; the host copy's bytes on rank 0; the bytes of one checkpoint."""
    import torch.distributed as dist

    set_seed(1234)
    rounds = opts.steps + 1
    engine, _ = setup_engine(lambda: GPTModel(args.model), accounting.count_parameters(args.model), args, dist_info,
                             opts.warmup + 3 * STEPS_BETWEEN * rounds * len(MODES))
    batches = random_batches(opts, 1000 + dist_info.rank)
    engines = {"sync": FlushingCheckpointEngine(engine._config), "async": HostCopyEngine(engine._config)}
    modes = {"sync": args, "async": replace(args, checkpoint=replace(args.checkpoint, async_save=True))}
    found = {mode: {"step": [], "blocked": [], "during": [], "wait": []} for mode in MODES}
    iteration, previous = 0, None

    def step() -> float:
        dist.barrier()
        start = time.perf_counter()
        train_step(engine, batches, modes["sync"], dist_info, eod=VOCAB - 1)
        dist.barrier()
        return time.perf_counter() - start

    for _ in range(opts.warmup):
        step()
    for round_ in range(rounds):  # round 0 warms the page cache and the folder up: not timed
        for mode in MODES if round_ % 2 else MODES[::-1]:
            engine.checkpoint_engine = engines[mode]
            steps = [step() for _ in range(STEPS_BETWEEN)]
            iteration += 1
            dist.barrier()
            start = time.perf_counter()
            saver = save_in_background if mode == "async" else save_checkpoint
            saver(engine, modes[mode], iteration, 0, dist_info.rank, None)
            dist.barrier()
            blocked = time.perf_counter() - start
            during, waited = [], 0.0
            if mode == "async":
                during = [step() for _ in range(STEPS_BETWEEN)]
                start = time.perf_counter()
                finish(engine, "the bench's next save")
                dist.barrier()
                waited = time.perf_counter() - start
            if dist_info.rank == 0 and previous is not None:
                shutil.rmtree(os.path.join(args.checkpoint.save, previous))
            previous = protocol.tag_name(iteration)
            if round_:
                for name, value in (("step", steps), ("blocked", [blocked]), ("during", during), ("wait", [waited])):
                    found[mode][name] += value
    size = sum(protocol.read_marker(os.path.join(args.checkpoint.save, previous))["files"].values())
    host = engines["async"].host_bytes
    engine.destroy()
    return {"found": found, "size": size, "host": host}


def report(stage: str, measured: dict) -> list[str]:
    found, step = measured["found"], float(np.median(measured["found"]["sync"]["step"] +
                                                     measured["found"]["async"]["step"]))
    sync, stall = float(np.median(found["sync"]["blocked"])), float(np.median(found["async"]["blocked"]))
    during = float(np.median(found["async"]["during"]))
    wait = float(np.median(found["async"]["wait"]))
    return [f"| {stage} | {measured['size'] / 1e6:.0f} | {measured['host'] / 1e6:.0f} | {step:.3f} | {sync:.3f} | "
            f"{100 * sync / step:.0f}% | {stall:.3f} | {100 * stall / step:.1f}% | {during:.3f} "
            f"({100 * (during / step - 1):+.0f}%) | {wait:.3f} |",
            f"ZeRO {stage}: each round's sync save / async stall (s): "
            + ", ".join(f"{s:.2f}/{a:.3f}" for s, a in zip(found["sync"]["blocked"], found["async"]["blocked"]))]


def main(argv) -> int:
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator
    from megatron.core.parallel_state import ParallelLayout, ParallelState

    opts = bench_options(argv)
    silence_known_warnings()
    dist_info = initialize_distributed(timeout_minutes=10.0)
    dist_info = replace(dist_info, parallel=ParallelState.build(ParallelLayout(dist_info.world_size)))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        prefix = toy_dataset(Path(tmp))
        found = [os.environ.get("ZL_BENCH_SAVE_DIR", os.path.join(tmp, "ckpt"))]
        dist.broadcast_object_list(found, src=0)
        for stage in opts.stages.split(","):
            args, _ = prepare_run(parse_args([*flags(opts, stage, prefix, dist_info.world_size), "--save", found[0]],
                                             dist_info.world_size, get_accelerator().device_name()), verbose=False)
            rows += report(stage, measure(args, opts, dist_info))
            if dist_info.rank == 0:
                shutil.rmtree(found[0], ignore_errors=True)
    if dist_info.rank == 0:
        print(f"\nGPT L={opts.num_layers} h={opts.hidden_size} seq={opts.seq_length} micro={opts.micro_batch_size} "
              f"ranks={dist_info.world_size} device={'cuda' if dist_info.on_cuda else 'cpu'}; {opts.steps} timed saves "
              f"per mode, taking turns; load average {os.getloadavg()[0]:.2f}")
        print("| ZeRO stage | MB per save | host copy MB (rank 0) | step s (median) | sync save s | sync / step | "
              "async stall s | stall / step | step s while writing | async wait s after those steps |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for row in rows:
            if row.startswith("|"):
                print(row)
        for row in rows:
            if not row.startswith("|"):
                print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
