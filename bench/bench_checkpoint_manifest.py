"""What the checkpoint manifest costs a save: seconds per real save (megatron/checkpointing/save_load.py's
save_checkpoint: every rank's DeepSpeed files, the fsyncs, the gather, the marker, the commit) with each
file's CRC-32 taken while it is written, and without (FlushingCheckpointEngine(checksums=False): the save
as it was before the manifest), and what a resume's check of the files reads back.

One engine on the ranks (the real DeepSpeed engine through setup_engine, after a few training steps so the
optimizer state exists); the two modes take turns save by save, in alternating order, each save under a new
tag in the same folder (the tag before removed outside the timing), so a drift in machine load hits both.
The cost is the median over rounds of the paired ratio (manifest / without) minus 1, for the wall time and
for the CPU time of all ranks' processes (what hashing adds, without the disk's and the machine's noise).

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 bench/bench_checkpoint_manifest.py
"""
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from common import VOCAB, random_batches, stage_args, start_ranks, toy_dataset, training_bench_parser
from megatron import accounting
from megatron.checkpointing import protocol, writer
from megatron.checkpointing.checksum import StreamCRC
from megatron.checkpointing.save_load import save_checkpoint
from megatron.checkpointing.writer import FlushingCheckpointEngine
from megatron.initialize import DistInfo, set_seed
from megatron.model import GPTModel
from megatron.engine import setup_engine
from megatron.training import train_step

MODES = ("without manifest", "manifest")


class TimedStreamCRC(StreamCRC):
    """StreamCRC counting the seconds spent in it and the bytes it hashed (this rank's, since the last reset):
    the manifest's own cost, apart from the disk's and the machine's noise."""
    seconds, hashed, written = 0.0, 0, 0

    def update(self, data) -> None:
        start = time.perf_counter()
        super().update(data)
        TimedStreamCRC.seconds += time.perf_counter() - start

    def finish(self, path: str) -> int:
        start = time.perf_counter()
        crc = super().finish(path)
        TimedStreamCRC.seconds += time.perf_counter() - start
        TimedStreamCRC.hashed += self.hashed
        TimedStreamCRC.written += self.size
        return crc


writer.StreamCRC = TimedStreamCRC  # FlushingCheckpointEngine builds one per file


def paired_cost_pct(mode: list[float], without: list[float]) -> float:
    """The median over rounds of one round's manifest save over its save without (neighbours in time)."""
    return 100.0 * (float(np.median([m / w for m, w in zip(mode, without)])) - 1.0)


def bench_options(argv):
    parser = training_bench_parser(__doc__, "1", 6, "timed saves per mode")
    parser.set_defaults(num_layers=4, hidden_size=1024, num_attention_heads=16, seq_length=64, micro_batch_size=1,
                        gradient_accumulation=1, warmup=1)
    opts = parser.parse_args(argv)
    opts.compile = False  # common.flags reads it
    return opts


def measure(args, opts, dist_info: DistInfo):
    """Wall seconds and CPU seconds (all ranks' processes together) of each timed save per mode, the bytes
    of one save, the seconds the resume's check of a manifest save took (rank 0 reads every file back), and
    per manifest save (seconds in StreamCRC, bytes it hashed, bytes written), all ranks together."""
    import torch.distributed as dist

    set_seed(1234)
    engine, _ = setup_engine(lambda: GPTModel(args.model), accounting.count_parameters(args.model), args,
                             dist_info, opts.warmup + 1)
    batches = random_batches(opts, 1000 + dist_info.rank)
    for _ in range(opts.warmup):
        train_step(engine, batches, args, dist_info, eod=VOCAB - 1)
    save_dir, engines = args.checkpoint.save, {mode: FlushingCheckpointEngine(engine._config,
                                                                             checksums=mode == "manifest")
                                               for mode in MODES}
    wall, cpu = {mode: [] for mode in MODES}, {mode: [] for mode in MODES}
    iteration, previous, manifest_code = 0, None, []

    def save(mode: str) -> tuple[float, float]:
        nonlocal iteration, previous
        engine.checkpoint_engine = engines[mode]
        iteration += 1
        TimedStreamCRC.seconds, TimedStreamCRC.hashed, TimedStreamCRC.written = 0.0, 0, 0
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        save_checkpoint(engine, args, iteration, 0, dist_info.rank)  # ends with a barrier
        seconds, cpu_seconds = time.perf_counter() - start, [None] * dist_info.world_size
        dist.all_gather_object(cpu_seconds, time.process_time() - start_cpu)
        if mode == "manifest":
            own = [None] * dist_info.world_size
            dist.all_gather_object(own, (TimedStreamCRC.seconds, TimedStreamCRC.hashed, TimedStreamCRC.written))
            manifest_code.append(tuple(map(sum, zip(*own))))
        if dist_info.rank == 0 and previous is not None:
            shutil.rmtree(os.path.join(save_dir, previous))
        previous = protocol.tag_name(iteration)
        return seconds, sum(cpu_seconds)

    for round_ in range(opts.steps + 1):  # round 0 warms the page cache and the folder up: not timed
        for mode in MODES if round_ % 2 else MODES[::-1]:
            seconds, cpu_seconds = save(mode)
            if round_:
                wall[mode].append(seconds)
                cpu[mode].append(cpu_seconds)
    save("manifest")
    folder = os.path.join(save_dir, previous)
    size = sum(protocol.read_marker(folder)["files"].values())
    checked = 0.0
    if dist_info.rank == 0:
        start = time.perf_counter()
        assert protocol.resume_tag(save_dir).tag == previous
        checked = time.perf_counter() - start
    engine.destroy()
    return wall, cpu, size, checked, manifest_code


def main(argv) -> int:
    import torch.distributed as dist

    opts = bench_options(argv)
    dist_info = start_ranks()
    with tempfile.TemporaryDirectory() as tmp:
        prefix = toy_dataset(Path(tmp))
        # one folder for all ranks: rank 0's (ZL_BENCH_SAVE_DIR puts it on another filesystem)
        found = [os.environ.get("ZL_BENCH_SAVE_DIR", os.path.join(tmp, "ckpt"))]
        dist.broadcast_object_list(found, src=0)
        save_dir = found[0]
        rows = []
        for stage in opts.stages.split(","):
            args = stage_args(opts, stage, prefix, dist_info, "--save", save_dir)
            rows.append((stage, *measure(args, opts, dist_info)))
            if dist_info.rank == 0:
                shutil.rmtree(save_dir, ignore_errors=True)
    if dist_info.rank == 0:
        device = "cuda" if dist_info.on_cuda else "cpu"
        print(f"\nGPT L={opts.num_layers} h={opts.hidden_size} ranks={dist_info.world_size} device={device} "
              f"dtype={'bf16' if opts.bf16 else 'fp32'}; {opts.steps} timed saves per mode, taking turns; "
              f"load average {os.getloadavg()[0]:.2f}")
        print("| ZeRO stage | MB per save | mode | wall s (median) | wall s (fastest) | CPU s, all ranks (median) | "
              "manifest / without: wall (paired median) | CPU (paired median) |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for stage, wall, cpu, size, checked, _ in rows:
            for mode in MODES:
                costs = ["", ""]
                if mode == "manifest":
                    costs = [f"{paired_cost_pct(measured['manifest'], measured['without manifest']):+.1f}%"
                             for measured in (wall, cpu)]
                print(f"| {stage} | {size / 1e6:.0f} | {mode} | {np.median(wall[mode]):.3f} | {min(wall[mode]):.3f} | "
                      f"{np.median(cpu[mode]):.3f} | {costs[0]} | {costs[1]} |")
        for stage, wall, _, size, checked, manifest_code in rows:
            print(f"ZeRO {stage}: each save's wall s, without / manifest: "
                  + ", ".join(f"{w:.2f}/{m:.2f}" for w, m in zip(wall["without manifest"], wall["manifest"])))
            code_s, hashed, written = (float(np.median(column)) for column in zip(*manifest_code))
            print(f"ZeRO {stage}: the manifest's own code per save (all ranks, median): {code_s * 1e3:.1f} ms, "
                  f"{hashed / 1e6:.2f} MB hashed of {written / 1e6:.0f} MB written (the rest: torch's record "
                  f"CRC-32s, reused); {100 * code_s / float(np.median(wall['without manifest'])):.2f}% of a save "
                  "without the manifest")
            print(f"ZeRO {stage}: the resume's check of one save (rank 0 reads {size / 1e6:.0f} MB back, page cache "
                  f"warm): {checked:.2f} s ({size / 1e6 / checked:.0f} MB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
