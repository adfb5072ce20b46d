"""Host-device synchronizations and step time per training step at each ZeRO stage, before and after issue 55.

Per stage, two engines from setup_engine over the same flags, run one after the other in this process:
  before: DeepSpeed's defaults that issue 55 changed (setup_engine's deepspeed_defaults:
          megatron/deepspeed_defaults.py),
  after:  zero-lab's settings, as every run has them.
Each trains --warmup steps, then --steps timed steps (tokens/s from the median), then --count-steps steps counted:
  host reads: .item(), bool()/float()/int() of a tensor, .tolist(), .cpu()/.numpy() and the accelerator's synchronize
              made in zero-lab's and DeepSpeed's frames (bench/common.py's counting_host_reads, the counter
              of tests/test_host_syncs.py); on a CPU rank this is the whole count,
  on CUDA, from torch.profiler: the CUDA runtime's synchronizing calls (cudaDeviceSynchronize, cudaStreamSynchronize,
              cudaEventSynchronize) and the device-to-host copies (Memcpy DtoH), whoever made them.
Batches are random tokens (data loading is not measured); no logging iteration is among the counted steps.

    GPU:  python -m torch.distributed.run --nproc_per_node 1 bench/bench_syncs.py --bf16 --num-layers 12 \\
              --hidden-size 768 --num-attention-heads 12 --seq-length 1024 --micro-batch-size 8 \\
              --gradient-accumulation 1 --json syncs.json     (bench/gpu_suite.sh --perf runs it so)
    CPU:  DS_ACCELERATOR=cpu python -m torch.distributed.run --nproc_per_node 1 bench/bench_syncs.py --bf16
"""
import gc
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from common import (VOCAB, counting_host_reads, random_batches, stage_args, start_ranks, synchronize, timed_steps,
                    toy_dataset, training_bench_parser)
from megatron import accounting
from megatron.initialize import set_seed
from megatron.model import GPTModel
from megatron.engine import setup_engine
from megatron.training import train_step

MEGATRON = str(Path(__file__).resolve().parent.parent / "megatron")
SIDES = ("before", "after")
# The CUDA runtime calls that make the host wait for the device
CUDA_SYNCS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize")


def options(argv):
    parser = training_bench_parser(__doc__, "0,1,2,3", 10, "timed steps per engine")
    parser.add_argument("--count-steps", type=int, default=3, help="steps whose synchronizations are counted")
    opts = parser.parse_args(argv)
    opts.compile = False  # stage_args' flags read it: the counts are of the eager step
    return opts


def count_step_syncs(engine, batches, args, dist_info, steps: int) -> dict:
    """Per step: host reads in zero-lab's and DeepSpeed's frames, by kind, and on CUDA the profiler's syncs."""
    import deepspeed

    reads = {}
    activities = [torch.profiler.ProfilerActivity.CPU]
    if dist_info.on_cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profile:
        with counting_host_reads(reads, (MEGATRON, os.path.dirname(deepspeed.__file__))):
            for _ in range(steps):
                train_step(engine, batches, args, dist_info, eod=VOCAB - 1)
        synchronize(dist_info)
    by_kind = {}
    for (name, _file, _line), count in reads.items():
        by_kind[name] = by_kind.get(name, 0) + count / steps
    names = [event.name for event in profile.events()]
    result = {"host_reads": sum(by_kind.values()), "host_reads_by_kind": by_kind}
    if dist_info.on_cuda:
        result["cuda_syncs_by_call"] = {call: names.count(call) / steps for call in CUDA_SYNCS if call in names}
        result["cuda_syncs"] = sum(result["cuda_syncs_by_call"].values())
        result["d2h_copies"] = sum(name.startswith("Memcpy DtoH") for name in names) / steps
    return result


def measure(side: str, args, opts, dist_info) -> dict:
    set_seed(1234)
    total = opts.warmup + opts.steps + opts.count_steps
    engine, _ = setup_engine(lambda: GPTModel(args.model), accounting.count_parameters(args.model), args, dist_info,
                             total, deepspeed_defaults=side == "before")
    batches = random_batches(opts, 1000 + dist_info.rank)
    seconds = timed_steps(engine, batches, args, opts, dist_info)
    counts = count_step_syncs(engine, batches, args, dist_info, opts.count_steps)
    engine.destroy()
    del engine
    gc.collect()
    tokens = args.training.global_batch_size * opts.seq_length
    ms = 1000 * statistics.median(seconds)
    return {"side": side, "ms_per_step": ms, "tokens_per_s": tokens / (ms / 1000), **counts}


def main(argv) -> int:
    opts = options(argv)
    dist_info = start_ranks()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        prefix = toy_dataset(Path(tmp))
        for stage in opts.stages.split(","):
            args = stage_args(opts, stage, prefix, dist_info)
            for side in SIDES:
                rows.append({"stage": int(stage), **measure(side, args, opts, dist_info)})
    if dist_info.rank == 0:
        device = torch.cuda.get_device_name() if dist_info.on_cuda else "cpu"
        shape = (f"L={opts.num_layers} h={opts.hidden_size} s={opts.seq_length} micro={opts.micro_batch_size} "
                 f"accumulation={opts.gradient_accumulation} ranks={dist_info.world_size} "
                 f"dtype={'bf16' if opts.bf16 else 'fp32'}")
        print(f"GPT {shape} device={device}")
        print("| ZeRO stage | side | ms/step | tokens/s | host reads/step | CUDA syncs/step | D2H copies/step |")
        print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
        for row in rows:
            print(f"| {row['stage']} | {row['side']} | {row['ms_per_step']:.1f} | {row['tokens_per_s']:.0f} | "
                  f"{row['host_reads']:.1f} | {row.get('cuda_syncs', 'n/a')} | {row.get('d2h_copies', 'n/a')} |")
        if opts.json:
            Path(opts.json).write_text(json.dumps({"device": device, "shape": shape, "rows": rows}, indent=2) + "\n")
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
