"""The DeepSpeed JSON config: generated from the parsed flags, or a user's file with the flags merged in
(megatron/deepspeed_json.py).

`deepspeed_config(args, num_params, hidden_size)` is the one place that writes a DeepSpeed config;
`write_deepspeed_config` puts the config actually used into the run folder (atomically).
"""
import json
import os
from pathlib import Path

from megatron.arguments import Args
from megatron.curriculum import SECTION as CURRICULUM_SECTION
from megatron.accounting.predict.traffic import OWNER_REDUCTION

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
        # a parameter is released after its forward and gathered again for its backward, the ZeRO paper's
        # 3x traffic that megatron/accounting/predict/ predicts; keeping it for reuse would trade the
        # memory stage 3 saves back for traffic, by an amount that depends on the model's module order
        "stage3_max_reuse_distance": 0,
    }


def _nvme_section(num_params: int, nvme_path: str) -> dict:
    """ZeRO-Infinity: optimizer states and parameter partitions swapped to files under nvme_path
    through DeepSpeed's async I/O op. A parameter buffer must hold the largest partition (at most
    the whole model); 1e8 elements, DeepSpeed's default, is the ceiling."""
    buffer = min(100_000_000, num_params + ALIGNMENT - num_params % ALIGNMENT)
    return {
        "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path, "pin_memory": False, "buffer_count": 4},
        "offload_param": {"device": "nvme", "nvme_path": nvme_path, "pin_memory": False, "buffer_count": 5,
                          "buffer_size": buffer, "max_in_cpu": 0},
    }


# DeepSpeed's async I/O: 1 MiB requests, 8 in flight per thread; one thread, as the CPU ranks share two cores (on
# a GPU node raise intra_op_parallelism, the key DeepSpeed 0.19 reads for its threads, to the drive's queue count)
AIO = {"block_size": 1_048_576, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
       "overlap_events": True}


def _zero_section(args: Args, num_params: int, hidden_size: int, on_cuda: bool) -> dict:
    ds = args.deepspeed
    sizes = bucket_sizes(num_params, hidden_size)
    zero = {"stage": ds.zero_stage}
    if ds.zero_stage == 0:
        return zero
    # ranks holding the same parameters (data- times DeepSpeed-Ulysses sequence-parallel): with one, ZeRO shares
    # nothing and sends nothing, and what serves the sharing only costs host time (docs/gpu-reference.md)
    shared = args.parallel.data_parallel_size * args.parallel.sequence_parallel_size > 1
    # overlap_comm reduces on a side stream, and DeepSpeed 0.19.8 synchronizes the device before each bucket's
    # reduction to do so (allreduce_and_copy): worth it only where there is communication to hide
    zero.update(contiguous_gradients=True, overlap_comm=on_cuda and shared,
                reduce_bucket_size=sizes["reduce_bucket_size"])
    if ds.zero_stage in (1, 2):
        # reduce each gradient partition to its owner: DeepSpeed's default all-reduces buckets that span
        # several partitions, which sends twice the ZeRO paper's volume for the same result
        zero.update(allgather_bucket_size=sizes["allgather_bucket_size"], **OWNER_REDUCTION)
    else:
        zero.update({key: value for key, value in sizes.items() if key.startswith("stage3_")})
        if not shared and not ds.offload_params and ds.nvme_path is None:
            # one rank's "partition" is the whole parameter: keep every one whole rather than release it after its
            # forward and gather it again (through hooks) for its backward; offload still moves them off the GPU
            zero["stage3_param_persistence_threshold"] = num_params
    if ds.nvme_path is not None:
        zero.update(_nvme_section(num_params, ds.nvme_path))
        return zero
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": on_cuda}
    if ds.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": on_cuda}
    return zero


def deepspeed_clipping(args: Args) -> float:
    """The gradient_clipping DeepSpeed gets: --clip-grad (or the JSON's), except at stage 0 in fp32, where
    DeepSpeed hands the step straight to our optimizer, which clips itself (so that the logged grad norm is
    the pre-clip norm, as with ZeRO); there DeepSpeed's engine would clip a second time, so it gets 0."""
    clip_in_optimizer = args.deepspeed.zero_stage == 0 and args.deepspeed.precision == "fp32"
    return 0.0 if clip_in_optimizer else args.optimizer.clip_grad


def generate_config(args: Args, num_params: int, hidden_size: int, on_cuda: bool) -> dict:
    ds, train = args.deepspeed, args.training
    config = {
        "train_batch_size": train.global_batch_size,
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": train.gradient_accumulation_steps,
        "gradient_clipping": deepspeed_clipping(args),
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer (on by default) synchronizes the device at every forward and every step to
        # time them; zero-lab times its steps itself (megatron/training.py, at its logging iterations only)
        "timers": {"throughput": {"enabled": False}},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": ds.bf16},
        "fp16": {"enabled": ds.fp16, "loss_scale": ds.loss_scale, "initial_scale_power": 16,
                 "loss_scale_window": 1000, "hysteresis": ds.hysteresis, "min_loss_scale": 1},
        "zero_optimization": _zero_section(args, num_params, hidden_size, on_cuda),
    }
    if ds.bf16 and ds.zero_stage >= 1:
        # sum the micro-batches' gradients in fp32, as Megatron-DeepSpeed's bf16 configs do (by default DeepSpeed
        # sums them in bf16). Stage 1 then runs DeepSpeed's bf16 optimizer, with an fp32 buffer of every gradient;
        # DeepSpeed 0.19.8 refuses fp32 accumulation at stage 0 ("unsupported mix"), which accumulates in bf16.
        config["data_types"] = {"grad_accum_dtype": "fp32"}
        if args.parallel.data_parallel_size * args.parallel.sequence_parallel_size == 1:
            # DeepSpeed's communication dtype defaults to the model's: the fp32 sums were cast to bf16 for a
            # reduction over one rank and back. With several ranks the reductions stay bf16, the ZeRO paper's
            # volumes (a JSON's "communication_data_type": "fp32" sends twice the gradients' bytes, as predicted)
            config["communication_data_type"] = "fp32"
    if args.deepspeed.nvme_path is not None:
        config["aio"] = dict(AIO)
    return config


# The zero_optimization keys of the generated config that a user's JSON takes where it leaves them out: the
# communication settings the traffic and step-time predictions assume (the stage and offload are the flags')
_TUNED_ZERO_SKIP = ("stage", "offload_optimizer", "offload_param")


def _complete_user_config(user: dict, args: Args, tuned: dict) -> dict:
    """The user's JSON (the flags merged in) with all three batch keys and the clipping the run uses: the batch
    keys it gives agree with the flags and with each other (checked when the flags were parsed, by DeepSpeed's
    rule), the others follow from them and the layout; its gradient_clipping is --clip-grad's default. Every key
    it sets is kept; `tuned`, the config zero-lab would generate, fills its tuned zero_optimization keys, the bf16
    gradient accumulation's data_types and communication_data_type, NVMe's aio and the timers where the JSON leaves them out (`tuned_keys_added`)."""
    train = args.training
    config = json.loads(json.dumps(user))  # a deep copy: the parsed flags keep the user's JSON as read
    config.update(train_batch_size=train.global_batch_size, train_micro_batch_size_per_gpu=train.micro_batch_size,
                  gradient_accumulation_steps=train.gradient_accumulation_steps,
                  gradient_clipping=deepspeed_clipping(args))
    config.setdefault("zero_allow_untested_optimizer", True)
    zero = config.setdefault("zero_optimization", {})
    for key, value in tuned["zero_optimization"].items():
        if key not in _TUNED_ZERO_SKIP:
            zero.setdefault(key, value)
    for key in ("data_types", "communication_data_type", "aio", "timers"):
        if key in tuned:
            config.setdefault(key, tuned[key])
    return config


def tuned_keys_added(user: dict, config: dict) -> list[str]:
    """The keys, dotted, that zero-lab's tuned settings added to a user's JSON (`_complete_user_config`)."""
    added = [f"zero_optimization.{key}" for key in config.get("zero_optimization", {})
             if key not in _TUNED_ZERO_SKIP and key not in user.get("zero_optimization", {})]
    return added + [key for key in ("data_types", "communication_data_type", "aio", "timers")
                    if key in config and key not in user]


def deepspeed_config(args: Args, num_params: int, hidden_size: int, on_cuda: bool) -> dict:
    config = generate_config(args, num_params, hidden_size, on_cuda)
    if args.deepspeed.user_config is not None:
        config = _complete_user_config(args.deepspeed.user_config, args, config)
        # DeepSpeed 0.19 refuses its legacy curriculum key: zero-lab runs that curriculum (megatron/curriculum.py)
        config.pop(CURRICULUM_SECTION, None)
    if args.checkpoint.universal_checkpoint:  # DeepSpeed then loads the per-parameter files ds_to_universal wrote
        config["checkpoint"] = {**config.get("checkpoint", {}), "load_universal": True}
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
