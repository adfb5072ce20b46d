"""The DeepSpeed engine a run trains: the model, optimizer and schedule built under the flags' DeepSpeed config,
on the rank's device, compiled with --compile."""
from types import SimpleNamespace

from megatron.arguments import Args
from megatron.deepspeed_quiet import EXPERT_GROUP_CREATED, without_lines
from megatron.initialize import DistInfo


def engine_device_args(dist_info: DistInfo) -> SimpleNamespace | None:
    """What deepspeed.initialize takes as `args` to use the rank's GPU: its engine sets the device again, to
    LOCAL_RANK unless args.device_rank says otherwise, which breaks sites that give each rank its own GPU
    (every rank sees index 0: megatron/initialize.py)."""
    return SimpleNamespace(device_rank=dist_info.device.index) if dist_info.on_cuda else None


def setup_engine(model_builder, num_params: int, args: Args, dist_info: DistInfo, train_iters: int,
                 deepspeed_defaults: bool = False, zero_overrides: dict | None = None):
    """Build the model (partitioned at creation under ZeRO-3), optimizer, schedule and DeepSpeed engine.
    `deepspeed_defaults` (benchmarks' "before" only) restores what issue 55 changed: megatron/deepspeed_defaults.py.
    dist_info.parallel is DeepSpeed's mpu (ZeRO partitions over the ranks holding the same parameters: data- and
    DeepSpeed-Ulysses sequence-parallel ones) except for a PipelineModule, which brings its own grid.
    `zero_overrides`: keys set in the config's zero_optimization section (megatron/accounting/measure/host_probe.py's
    skeletons'
    bucket sizes). Returns (engine, the DeepSpeed config actually used)."""
    state = dist_info.parallel
    mpu = state if args.parallel.pipeline_model_parallel_size == 1 else None
    import deepspeed

    from megatron.deepspeed_config import deepspeed_config
    from megatron.optimizer import LRSchedule, build_optimizer, import_muon_uncompiled
    from megatron.stage0_optimizer import whole_norm_unfused_optimizer
    from megatron.zero_clipping import clip_without_host_reads

    config = deepspeed_config(args, num_params, args.model.hidden_size, dist_info.on_cuda)
    if deepspeed_defaults:
        from megatron.deepspeed_defaults import restore_deepspeed_defaults
        config = restore_deepspeed_defaults(config, args.model.hidden_size, num_params, dist_info.on_cuda)
    if zero_overrides:
        config["zero_optimization"] = {**config.get("zero_optimization", {}), **zero_overrides}
    if args.model.recompute_with_deepspeed:  # before the model is built, as Megatron-DeepSpeed's initialize
        from megatron.core.tensor_parallel.random import configure_deepspeed_checkpointing
        stage_layers = args.model.num_layers // args.parallel.pipeline_model_parallel_size
        # DeepSpeed 0.19.8's CPU checkpointing would empty the checkpoints on CPU ranks (its copy to the CPU is the
        # tensor itself), so --checkpoint-in-cpu applies to its checkpoint on CUDA only (zero-lab's own recompute
        # offloads through megatron/core/tensor_parallel/activation_offload.py, on CPU ranks too)
        configure_deepspeed_checkpointing(state, config, stage_layers,
                                          args.deepspeed.checkpoint_in_cpu and dist_info.on_cuda)
    if args.deepspeed.zero_stage == 3:
        # each rank materialises only its shard; the full model never sits on one rank
        with deepspeed.zero.Init(config_dict_or_path=config, remote_device="cpu" if args.deepspeed.offload_params
                                 else None, pin_memory=dist_info.on_cuda and args.deepspeed.offload_params, mpu=mpu,
                                 # partition (and broadcast at creation) over the ranks holding the same
                                 # parameters only, or the tensor-parallel ranks would all get rank 0's shards
                                 data_parallel_group=None if mpu is None
                                 else mpu.get_sequence_data_parallel_group()):
            model = model_builder()
    else:
        model = model_builder().to(dist_info.device)
    optimizer = build_optimizer(model, args, state)
    schedule = LRSchedule(optimizer, args.optimizer, train_iters, args.training.global_batch_size,
                          args.training.train_samples)
    import_muon_uncompiled()
    # stage 0 in 16-bit: one host read a step, a norm with the experts; each rank's line for the expert groups
    # the engine always creates is dropped
    with whole_norm_unfused_optimizer(enabled=not deepspeed_defaults), without_lines(EXPERT_GROUP_CREATED):
        engine, _, _, _ = deepspeed.initialize(args=engine_device_args(dist_info), model=model, optimizer=optimizer,
                                               lr_scheduler=schedule, config=config, mpu=mpu,
                                               dist_init_required=False)
    if not deepspeed_defaults:
        clip_without_host_reads(engine.optimizer)  # ZeRO 1-2: no host read per optimizer group (docs/gpu-reference.md)
    if args.training.compile:
        compile_engine(engine, args.deepspeed.zero_stage, pipeline=mpu is None)
    return engine, config


def compile_engine(engine, zero_stage: int, pipeline: bool) -> None:
    """--compile: DeepSpeed's engine.compile(), torch.compile of the model it wraps (docs/gpu.md, torch.compile).
    ZeRO-3 gathers a parameter read outside its module's forward when the read goes through the module's parameter
    dict; compiled code reads that dict's tensors directly, and would trace the output layer's weight as its empty
    partition. Registered with the whole model, the model's own forward gathers it first."""
    import deepspeed

    if zero_stage == 3 and not pipeline:
        deepspeed.zero.register_external_parameter(engine.module, engine.module.output_weight())
    engine.compile()
