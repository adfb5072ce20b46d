"""Training throughput of zero-lab's GPT against Hugging Face's GPT2LMHeadModel of the same size.

Both models go through the same path: the same parsed flags, the same generated DeepSpeed config,
setup_engine (zero.Init at stage 3) and the real train_step, one ZeRO stage after another in the
same processes on the same machine; batches are random tokens (data loading is not measured).
Per stage the runs go ours, HF, HF, ours, and each side's tokens/s is from its median step time.
The defaults are the tiny preset, seq 128, micro-batch 4, 2 micro-batches per step on 2 ranks (the
drivers' CPU experiment with gradient accumulation). --compile runs both models under torch.compile (engine.compile()).

Also printed: which SDPA kernel our attention ran (the aten op the profiler saw: flash, cuDNN,
memory-efficient or math), and on CUDA the peak allocator memory of one forward + backward of
the output layer and loss, our fused vocab_parallel_lm_loss against F.linear + F.cross_entropy.

    CPU:  DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 bench/bench_gpt_vs_hf.py
          DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 bench/bench_gpt_vs_hf.py --num-layers 4 \
              --hidden-size 256 --num-attention-heads 8 --seq-length 256 --gradient-accumulation 1
    GPU:  deepspeed --num_gpus 8 bench/bench_gpt_vs_hf.py --bf16 --gradient-accumulation 1 \
              --num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 --micro-batch-size 8
          (bench/gpu_suite.sh runs it this way on the visible GPUs, with and without --compile)
"""
import gc
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from common import (VOCAB, HFAdapter, random_batches, stage_args, start_ranks, timed_steps, toy_dataset,
                    training_bench_parser)
from megatron import accounting
from megatron.core.scratch import ScratchBuffers
from megatron.core.tensor_parallel import vocab_parallel_lm_loss
from megatron.initialize import DistInfo, set_seed
from megatron.model import GPTModel
from megatron.engine import setup_engine


def bench_options(argv):
    parser = training_bench_parser(__doc__, "0,1,2,3", 8, "timed steps per run; each model runs twice")
    parser.add_argument("--compile", action="store_true", help="torch.compile both models (--compile of pretrain_gpt)")
    return parser.parse_args(argv)


def measure(builder_name, args, opts, dist_info: DistInfo, config) -> list[float]:
    """Seconds of each of opts.steps training steps after opts.warmup (all ranks in step)."""
    set_seed(1234)
    builder = (lambda: GPTModel(config)) if builder_name == "ours" else (lambda: HFAdapter(config))
    engine, _ = setup_engine(builder, accounting.count_parameters(config), args, dist_info,
                             opts.warmup + opts.steps)
    seconds = timed_steps(engine, random_batches(opts, 1000 + dist_info.rank), args, opts, dist_info)
    engine.destroy()
    del engine
    gc.collect()
    return seconds


# The kernels F.scaled_dot_product_attention dispatches to, by the aten op the profiler records.
SDPA_KERNELS = {
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash (CPU)",
    "aten::_scaled_dot_product_cudnn_attention": "cuDNN",
    "aten::_scaled_dot_product_efficient_attention": "memory-efficient",
    "aten::_scaled_dot_product_fused_attention_overrideable": "fused (overrideable)",
    "aten::_scaled_dot_product_attention_math": "math",  # the unfused composite (on CPU: with dropout)
}


def attention_kernels(config, opts, device) -> list[str]:
    """The SDPA kernels one training forward + backward of our model ran, as "name (aten op)"."""
    model = GPTModel(config).to(device)
    tokens = torch.randint(0, VOCAB, (opts.micro_batch_size, opts.seq_length + 1), device=device)
    positions = torch.arange(opts.seq_length, device=device).expand(opts.micro_batch_size, -1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        model(tokens[:, :-1], positions, tokens[:, 1:]).mean().backward()
    names = {event.name for event in profile.events()}
    return [f"{kernel} ({op})" for op, kernel in SDPA_KERNELS.items() if op in names]


def loss_peak_mib(config, opts, device) -> dict | None:
    """Peak CUDA allocator MiB above the inputs for one forward + backward of the tied output layer
    and loss over a micro-batch: fused vs logits materialised by F.linear (HF's path); None off CUDA,
    where no allocator counts the peak."""
    if device.type != "cuda":
        return None
    generator = torch.Generator(device=device).manual_seed(0)
    tokens, h = opts.micro_batch_size * opts.seq_length, config.hidden_size
    hidden = torch.randn(tokens, h, device=device, dtype=config.params_dtype, generator=generator)
    weight = 0.02 * torch.randn(config.padded_vocab_size, h, device=device, dtype=config.params_dtype,
                                generator=generator)
    target = torch.randint(0, VOCAB, (tokens,), device=device, generator=generator)
    hidden.requires_grad_(True), weight.requires_grad_(True)

    def peak(loss_fn) -> float:
        hidden.grad = weight.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        loss_fn().mean().backward()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - start) / 2**20

    return {"fused": peak(lambda: vocab_parallel_lm_loss(hidden, weight, target, None, ScratchBuffers())),
            "linear + cross_entropy": peak(lambda: F.cross_entropy(F.linear(hidden, weight).float(), target,
                                                                   reduction="none"))}


def main(argv) -> int:
    opts = bench_options(argv)
    dist_info = start_ranks()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        prefix = toy_dataset(Path(tmp))
        for stage in opts.stages.split(","):
            args = stage_args(opts, stage, prefix, dist_info)
            config = args.model
            # ours, HF, HF, ours: a drift in machine load or a cold first run favours neither side;
            # the median step time resists the odd slow step (a page-cache miss, a busy neighbour)
            seconds = {"ours": [], "hf": []}
            for name in ("ours", "hf", "hf", "ours"):
                seconds[name] += measure(name, args, opts, dist_info, config)
            tokens_per_step = args.training.global_batch_size * opts.seq_length
            ours, hf = (tokens_per_step / float(np.median(seconds[name])) for name in ("ours", "hf"))
            flops = accounting.model_flops_per_iteration(config, args.training.global_batch_size)
            tflops = flops / (tokens_per_step / ours) / dist_info.world_size / 1e12
            peak = accounting.peak_tflops(torch.cuda.get_device_name() if dist_info.on_cuda else None,
                                          args.deepspeed.precision, torch.backends.cuda.matmul.allow_tf32)
            rows.append(dict(stage=int(stage), ours_tokens_per_s=ours, hf_tokens_per_s=hf, ratio=ours / hf,
                             ours_tflops_per_rank=tflops, ours_mfu=None if peak is None else tflops / peak))
    kernels = attention_kernels(config, opts, dist_info.device)
    loss_mib = loss_peak_mib(config, opts, dist_info.device)
    for row in rows:
        row.update(compile=opts.compile, attention_kernels=kernels, loss_peak_mib=loss_mib)
    if dist_info.rank == 0:
        print_table(rows, opts, dist_info, config)
        print(f"attention: SDPA ran {', '.join(kernels) or 'no SDPA kernel'}")
        if loss_mib is None:
            print("output layer + loss peak memory: n/a (no allocator peak off CUDA)")
        else:
            print("output layer + loss peak memory: "
                  + ", ".join(f"{name} {mib:.1f} MiB" for name, mib in loss_mib.items()))
        if opts.json:
            Path(opts.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


def print_table(rows, opts, dist_info, config):
    device = torch.cuda.get_device_name() if dist_info.on_cuda else "cpu"
    print(f"\nGPT L={opts.num_layers} h={opts.hidden_size} heads={opts.num_attention_heads} s={opts.seq_length} "
          f"micro={opts.micro_batch_size} accumulation={opts.gradient_accumulation} ranks={dist_info.world_size} "
          f"device={device} dtype={'bf16' if opts.bf16 else 'fp32'} compile={'on' if opts.compile else 'off'} "
          f"params={accounting.count_parameters(config):,}")
    print("| ZeRO stage | ours tokens/s | HF tokens/s | ours/HF | ours TFLOPs/rank | ours MFU |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        mfu = "n/a" if row["ours_mfu"] is None else f"{100 * row['ours_mfu']:.1f}%"
        print(f"| {row['stage']} | {row['ours_tokens_per_s']:.1f} | {row['hf_tokens_per_s']:.1f} | "
              f"{row['ratio']:.2f}x | {row['ours_tflops_per_rank']:.3f} | {mfu} |")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
