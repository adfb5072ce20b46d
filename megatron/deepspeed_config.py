"""The DeepSpeed JSON config: generated from the parsed flags, or a user's file checked against them.

`deepspeed_config(args, num_params, hidden_size)` is the one place that writes a DeepSpeed config;
`write_deepspeed_config` puts the config actually used into the run folder (atomically).
"""
import json
import os
from pathlib import Path

from megatron.arguments import Args, ConfigError, read_deepspeed_json

# DeepSpeed's defaults (5e8 elements per bucket) are larger than a whole GPT-2 125M model, so
# the communication buffers would dominate and hide what ZeRO saves; size them from the model.
MIN_BUCKET = 100_000
MAX_BUCKET = 500_000_000
# ZeRO asserts buckets are multiples of its communication alignment (a small power of two)
ALIGNMENT = 1024


def bucket_sizes(num_params: int, hidden_size: int) -> dict:
    """Bucket and stage-3 knobs scaled to the model (the h*h rule DeepSpeed's HF integration uses,
    floored at 1/20 of the model so tiny models do not drown in collectives)."""
    bucket = int(min(MAX_BUCKET, max(MIN_BUCKET, hidden_size * hidden_size, num_params // 20)))
    bucket -= bucket % ALIGNMENT
    return {
        "reduce_bucket_size": bucket,
        "allgather_bucket_size": bucket,
        "stage3_prefetch_bucket_size": int(0.9 * bucket),
        # small tensors (biases, LayerNorm) stay whole on every rank: gathering them costs more than it saves
        "stage3_param_persistence_threshold": 10 * hidden_size,
        # about four transformer layers' worth of gathered parameters alive at a time
        "stage3_max_live_parameters": max(MIN_BUCKET, 48 * hidden_size * hidden_size),
        "stage3_max_reuse_distance": max(MIN_BUCKET, 48 * hidden_size * hidden_size),
    }


def _zero_section(args: Args, num_params: int, hidden_size: int, on_cuda: bool) -> dict:
    ds = args.deepspeed
    sizes = bucket_sizes(num_params, hidden_size)
    zero = {"stage": ds.zero_stage}
    if ds.zero_stage == 0:
        return zero
    zero.update(contiguous_gradients=True, overlap_comm=on_cuda,
                reduce_bucket_size=sizes["reduce_bucket_size"])
    if ds.zero_stage in (1, 2):
        zero.update(allgather_bucket_size=sizes["allgather_bucket_size"], reduce_scatter=True)
    else:
        zero.update({key: value for key, value in sizes.items() if key.startswith("stage3_")})
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": on_cuda}
    if ds.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": on_cuda}
    return zero


def generate_config(args: Args, num_params: int, hidden_size: int, on_cuda: bool) -> dict:
    ds, train = args.deepspeed, args.training
    # At stage 0 in fp32 DeepSpeed hands the step straight to our optimizer, which clips itself
    # (so that the logged grad norm is the pre-clip norm, as with ZeRO); DeepSpeed must not clip twice.
    clip_in_optimizer = ds.zero_stage == 0 and ds.precision == "fp32"
    return {
        "train_batch_size": train.global_batch_size,
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": train.gradient_accumulation_steps,
        "gradient_clipping": 0.0 if clip_in_optimizer else args.optimizer.clip_grad,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": ds.bf16},
        "fp16": {"enabled": ds.fp16, "loss_scale": 0, "initial_scale_power": 16,
                 "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
        "zero_optimization": _zero_section(args, num_params, hidden_size, on_cuda),
    }


def _check_user_config(user: dict, args: Args, path: str) -> dict:
    """A user's JSON must agree with the flags on batch sizes; missing batch keys are filled in."""
    train = args.training
    expected = {"train_batch_size": (train.global_batch_size, "--global-batch-size"),
                "train_micro_batch_size_per_gpu": (train.micro_batch_size, "--micro-batch-size"),
                "gradient_accumulation_steps": (train.gradient_accumulation_steps, "--global-batch-size")}
    config = dict(user)
    for key, (value, flag) in expected.items():
        if key in config and config[key] != value:
            raise ConfigError(f"--deepspeed_config {path}: {key} is {config[key]} but {flag} gives {value}")
        config[key] = value
    config.setdefault("zero_allow_untested_optimizer", True)
    return config


def deepspeed_config(args: Args, num_params: int, hidden_size: int, on_cuda: bool) -> dict:
    path = args.deepspeed.deepspeed_config
    if path is not None:
        config = _check_user_config(read_deepspeed_json(path), args, path)
    else:
        config = generate_config(args, num_params, hidden_size, on_cuda)
    if args.parallel.sequence_parallel and args.parallel.pipeline_model_parallel_size > 1:
        # DeepSpeed's pipeline sends 1/TP of an activation and all-gathers it over the TP group, which assumes
        # the TP ranks hold replicas; with sequence parallelism each holds its own slice, so send it whole
        config["pipeline"] = {**config.get("pipeline", {}), "pipe_partitioned": False, "grad_partitioned": False}
    return config


def write_deepspeed_config(config: dict, run_dir: str) -> Path:
    """Write ds_config.json into run_dir via a temporary name, so a crash never leaves half a file."""
    target = Path(run_dir) / "ds_config.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".ds_config.json.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, target)
    return target
