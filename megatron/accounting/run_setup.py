"""The flags' TrainingSetup: what the accounting's estimates (megatron/accounting/predict/) read from a run's parsed
flags; the in-run report, the GPU drivers' micro-batch plan and the benches build it here."""
from megatron import accounting
from megatron.arguments import Args
from megatron.initialize import DistInfo


def training_setup(args: Args, dist_info: DistInfo):
    """What megatron/accounting/predict/'s traffic and memory estimates need from the parsed flags."""
    ds, par, train = args.deepspeed, args.parallel, args.training
    return accounting.TrainingSetup(
        world_size=par.world_size, micro_batch_size=train.micro_batch_size,
        gradient_accumulation_steps=train.gradient_accumulation_steps,
        tensor_parallel_size=par.tensor_model_parallel_size, pipeline_parallel_size=par.pipeline_model_parallel_size,
        sequence_parallel=par.sequence_parallel, sequence_parallel_size=par.sequence_parallel_size,
        expert_parallel_size=args.model.expert_parallel_size, precision=ds.precision, zero_stage=ds.zero_stage,
        offload_optimizer=ds.offload_optimizer, offload_params=ds.offload_params,
        offload_device="nvme" if ds.nvme_path else "cpu", activation_recompute=args.model.recompute_activations,
        activation_offload=_activation_offload(args, dist_info.on_cuda),
        device="cuda" if dist_info.on_cuda else "cpu", reduce_precision=_user_reduce_precision(ds.user_config))


def _activation_offload(args: Args, on_cuda: bool) -> bool:
    """--checkpoint-in-cpu's offload runs: zero-lab's host tier under its own recompute, DeepSpeed's cpu_checkpointing
    on CUDA under --deepspeed-activation-checkpointing (on CPU ranks megatron/engine.py leaves it off)."""
    model = args.model
    return model.recompute_offload or (model.recompute_with_deepspeed and args.deepspeed.checkpoint_in_cpu and on_cuda)


def _user_reduce_precision(user_config: dict | None) -> str | None:
    """A user's DeepSpeed JSON's communication_data_type (None where it leaves it to the generated config's)."""
    value = (user_config or {}).get("communication_data_type")
    return value.lower() if isinstance(value, str) else None
