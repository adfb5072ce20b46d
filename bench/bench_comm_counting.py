"""What counting the bytes of every collective costs: training tokens/s with megatron/accounting/measure/comm_counter.py off,
on, and, for reference, DeepSpeed's own comms logger (which synchronises after every op to time it).

The real DeepSpeed engine and train_step of bench_gpt_vs_hf.py, one ZeRO stage after another in the
same processes; per stage one engine, whose steps take turns between the modes (the counter installed
and removed between steps), so a drift in machine load favours none; each mode's tokens/s is from
its median step time, and its cost the median over rounds of its step time over the uncounted step's.
Defaults: the tiny preset, seq 128, micro-batch 4, 2 micro-batches per step on 2 ranks (the drivers'
CPU experiment with gradient accumulation).

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 bench/bench_comm_counting.py
    deepspeed --num_gpus 8 bench/bench_comm_counting.py --bf16 --num-layers 12 --hidden-size 768 \\
        --num-attention-heads 12 --seq-length 1024 --micro-batch-size 8 --gradient-accumulation 1
"""
import contextlib
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from common import VOCAB, random_batches, stage_args, start_ranks, synchronize, toy_dataset, training_bench_parser
from megatron import accounting
from megatron.accounting.measure import comm_counter
from megatron.initialize import DistInfo, set_seed
from megatron.model import GPTModel
from megatron.engine import setup_engine
from megatron.training import train_step

MODES = ("off", "counter", "deepspeed logger")


def bench_options(argv):
    opts = training_bench_parser(__doc__, "1,3", 30, "timed steps per mode").parse_args(argv)
    opts.compile = False  # common.flags reads it
    return opts


def set_mode(mode: str):
    """Switch counting and DeepSpeed's comms logger for the next step; returns the counter or None."""
    import deepspeed.comm

    counter = comm_counter.install() if mode == "counter" else None
    if counter is None:
        comm_counter.uninstall()  # torch's own functions, and DeepSpeed's references to them, back
    deepspeed.comm.configure(enabled=mode == "deepspeed logger", prof_all=mode == "deepspeed logger",
                             verbose=False)
    return counter


def measure(args, opts, dist_info: DistInfo) -> tuple[dict[str, list[float]], float]:
    """Seconds of each timed step per mode, and the bytes this rank sent per counted step. One engine;
    the modes take turns step by step (in a rotating order), so machine load drifts hit all alike."""
    set_seed(1234)
    engine, _ = setup_engine(lambda: GPTModel(args.model), accounting.count_parameters(args.model), args,
                             dist_info, opts.warmup + opts.steps * len(MODES))
    batches = random_batches(opts, 1000 + dist_info.rank)
    for _ in range(opts.warmup):
        train_step(engine, batches, args, dist_info, eod=VOCAB - 1)
    seconds, sent, calls = {mode: [] for mode in MODES}, [], 0
    for round_ in range(opts.steps):
        for mode in MODES[round_ % len(MODES):] + MODES[:round_ % len(MODES)]:
            counter = set_mode(mode)
            synchronize(dist_info)
            start = time.perf_counter()
            with counter.counting() if counter is not None else contextlib.nullcontext():
                train_step(engine, batches, args, dist_info, eod=VOCAB - 1)
            synchronize(dist_info)
            seconds[mode].append(time.perf_counter() - start)
            if counter is not None:
                sent.append(sum(counter.snapshot().values()))
                calls = sum(counter.calls.values())
    set_mode("off")
    engine.destroy()
    del engine
    gc.collect()
    return seconds, float(np.median(sent)), calls


def paired_cost_pct(mode_seconds: list[float], off_seconds: list[float]) -> float:
    """How much longer a step takes in a mode than without counting: the median over rounds of the
    ratio of the two steps of one round (neighbours in time, so the machine's load cancels)."""
    return 100.0 * (float(np.median([m / o for m, o in zip(mode_seconds, off_seconds)])) - 1.0)


def counting_cost_us(repeat: int = 200_000) -> float:
    """Microseconds the counter adds to one collective call: a wrapped no-op all_reduce against the bare
    no-op, on a 1024-element tensor (the A/B of whole steps above is at the mercy of the machine's load;
    this is the cost itself)."""
    import torch

    def all_reduce(tensor, op=None, group=None, async_op=False):
        return None

    counter = comm_counter.CommCounter(active=True)
    counter._group_sizes[None] = 2
    wrapped = comm_counter.wrap(all_reduce, comm_counter.OPS["all_reduce"], counter)
    tensor = torch.ones(1024)
    best = {}
    for name, fn in (("bare", all_reduce), ("wrapped", wrapped)) * 3:
        start = time.perf_counter()
        for _ in range(repeat):
            fn(tensor)
        best[name] = min(best.get(name, float("inf")), (time.perf_counter() - start) / repeat)
    return 1e6 * (best["wrapped"] - best["bare"])


def main(argv) -> int:
    opts = bench_options(argv)
    dist_info = start_ranks()
    rows, cost_us = [], counting_cost_us()
    with tempfile.TemporaryDirectory() as tmp:
        prefix = toy_dataset(Path(tmp))
        for stage in opts.stages.split(","):
            args = stage_args(opts, stage, prefix, dist_info)
            seconds, sent, calls = measure(args, opts, dist_info)
            tokens_per_step = args.training.global_batch_size * opts.seq_length
            rate = {mode: tokens_per_step / float(np.median(seconds[mode])) for mode in MODES}
            setup = accounting.TrainingSetup(world_size=dist_info.world_size, micro_batch_size=opts.micro_batch_size,
                                             gradient_accumulation_steps=opts.gradient_accumulation,
                                             precision="bf16" if opts.bf16 else "fp32", zero_stage=int(stage))
            predicted = sum(accounting.zero_traffic_per_step(args.model, setup).values())
            rows.append(dict(stage=int(stage), off_tokens_per_s=rate["off"], counter_tokens_per_s=rate["counter"],
                             logger_tokens_per_s=rate["deepspeed logger"],
                             counter_cost_pct=paired_cost_pct(seconds["counter"], seconds["off"]),
                             logger_cost_pct=paired_cost_pct(seconds["deepspeed logger"], seconds["off"]),
                             sent_mb_per_step=sent / 2**20, predicted_mb_per_step=predicted / 2**20,
                             collectives_per_step=calls,
                             counting_cost_pct=100.0 * calls * cost_us * 1e-6 / float(np.median(seconds["off"]))))
    if dist_info.rank == 0:
        device = "cuda" if dist_info.on_cuda else "cpu"
        print(f"\nGPT L={opts.num_layers} h={opts.hidden_size} s={opts.seq_length} micro={opts.micro_batch_size} "
              f"accumulation={opts.gradient_accumulation} ranks={dist_info.world_size} device={device} "
              f"dtype={'bf16' if opts.bf16 else 'fp32'} steps={opts.steps} per mode, taking turns")
        print("| ZeRO stage | off tokens/s | counter tokens/s | counter cost (paired) | DeepSpeed logger tokens/s | "
              "logger cost (paired) | sent MB/step (counted) | predicted MB/step | collectives/step | "
              "counting cost from its per-call time |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in rows:
            print(f"| {r['stage']} | {r['off_tokens_per_s']:.1f} | {r['counter_tokens_per_s']:.1f} | "
                  f"{r['counter_cost_pct']:+.2f}% | {r['logger_tokens_per_s']:.1f} | {r['logger_cost_pct']:+.2f}% | "
                  f"{r['sent_mb_per_step']:.3f} | {r['predicted_mb_per_step']:.3f} | {r['collectives_per_step']} | "
                  f"{r['counting_cost_pct']:.3f}% |")
        print(f"counter: {cost_us:.2f} us per collective call (wrapped no-op all_reduce against the bare one)")
        if opts.json:
            Path(opts.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
