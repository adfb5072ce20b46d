"""DeepSpeed 0.19.8's own behaviour where zero-lab changed it for speed on a GPU (issue 55, docs/gpu-reference.md), for
the "before" side of a benchmark only (bench/bench_syncs.py through `setup_engine(..., deepspeed_defaults=True)`); no
flag or driver setting reaches it, since every run should train with zero-lab's settings.

What it puts back: DeepSpeed's throughput timer (on by default; it synchronizes at every forward and step), stage 1-2's
overlap_comm on CUDA whatever the ranks (a synchronize per reduced bucket), stage 3's persistence threshold of
bucket_sizes (parameters released after their forward and gathered again, also on one rank), and in
setup_engine DeepSpeed's FP16_UnfusedOptimizer at stage 0 in 16-bit (host reads per parameter) and its ZeRO 1-2
clipping (a host read per optimizer group). The correctness changes of the same issue (fp32 gradient sums and
reductions on one rank) stay.
"""
from megatron.deepspeed_config import bucket_sizes


def restore_deepspeed_defaults(config: dict, hidden_size: int, num_params: int, on_cuda: bool) -> dict:
    """A copy of the generated config with DeepSpeed's timer, overlap_comm and stage-3 persistence as they were."""
    config = {**config, "zero_optimization": dict(config.get("zero_optimization", {}))}
    config.pop("timers", None)
    zero = config["zero_optimization"]
    if zero.get("stage", 0) >= 1:
        zero["overlap_comm"] = on_cuda
    if zero.get("stage", 0) == 3 and "offload_param" not in zero:
        zero["stage3_param_persistence_threshold"] = bucket_sizes(num_params, hidden_size)[
            "stage3_param_persistence_threshold"]
    return config
