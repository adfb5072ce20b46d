"""Pretrain a GPT with DeepSpeed: `python pretrain_gpt.py <Megatron-DeepSpeed flags>` under a launcher
(deepspeed, torchrun, mpiexec). Parse flags, build tokenizer -> padded vocab, datasets, model, train."""
import sys
from functools import partial

import torch

from megatron.arguments import Args, ConfigError, parse_args
from megatron.core.parallel_state import ParallelLayout, ParallelState
from megatron.initialize import DistInfo, initialize_distributed, launcher_world_size, set_seed
from megatron.training import LoopState, TrainingError, resolve_schedule


def build_data_iterators(args: Args, dist_info: DistInfo, train_iters: int, iteration: int, consumed_samples: int):
    """Train and validation iterators positioned where a run at `iteration` left them (as Megatron does,
    the validation stream continues across evaluations, so a resumed run sees the same validation batches)."""
    from megatron.data.data_samplers import build_pretraining_data_loader
    from megatron.data.gpt_dataset import build_train_valid_test_datasets

    batch, log = args.training.global_batch_size, args.logging
    # the test split is never evaluated during pretraining, so no test samples are asked for
    wanted = (train_iters * batch, train_iters // log.eval_interval * log.eval_iters * batch, 0)
    train_ds, valid_ds, _ = build_train_valid_test_datasets(args.data.data_path, args.data.split, wanted,
                                                             args.model.seq_length, args.training.seed)
    valid_consumed = iteration // log.eval_interval * log.eval_iters * batch
    layout = parallel_layout(args)
    # tensor- and pipeline-parallel ranks of one replica read the same data
    dp_rank, dp_size = layout.data_parallel_rank(dist_info.rank), layout.data_parallel_size
    loaders = [build_pretraining_data_loader(ds, consumed, args.training.micro_batch_size, dp_rank, dp_size)
               for ds, consumed in ((train_ds, consumed_samples), (valid_ds, valid_consumed))]
    return [None if loader is None else iter(loader) for loader in loaders]


def model_config(args: Args, padded_vocab: int, dist_info: DistInfo):
    from megatron.model import GPTConfig
    m = args.model
    dtype = torch.bfloat16 if args.deepspeed.bf16 else torch.float16 if args.deepspeed.fp16 else torch.float32
    return GPTConfig(num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
                     seq_length=m.seq_length, max_position_embeddings=m.max_position_embeddings,
                     padded_vocab_size=padded_vocab, ffn_hidden_size=m.ffn_hidden_size,
                     hidden_dropout=m.hidden_dropout, attention_dropout=m.attention_dropout,
                     init_method_std=m.init_method_std, checkpoint_activations=m.checkpoint_activations,
                     params_dtype=dtype, sequence_parallel=args.parallel.sequence_parallel)


def parallel_layout(args: Args) -> ParallelLayout:
    par = args.parallel
    return ParallelLayout(par.world_size, par.tensor_model_parallel_size, par.pipeline_model_parallel_size)


def step_functions(args: Args) -> dict:
    """With pipeline parallelism DeepSpeed's pipeline engine runs the micro-batches (train_batch)."""
    if args.parallel.pipeline_model_parallel_size == 1:
        return {}
    from megatron.pipeline_training import pipeline_evaluate, pipeline_train_step
    return dict(step_fn=pipeline_train_step, evaluate_fn=pipeline_evaluate)


def pretrain(args: Args, dist_info: DistInfo) -> LoopState:
    from megatron.checkpointing import load_checkpoint, set_rng_state
    from megatron.data.gpt_dataset import train_samples_per_epoch
    from megatron.tokenizer import build_tokenizer, padded_vocab_size
    from megatron.training import build_reporter, save, train
    from megatron.training_log import training_done_line

    set_seed(args.training.seed)
    tokenizer = build_tokenizer(args.data)
    padded = padded_vocab_size(tokenizer.vocab_size, args.data.make_vocab_size_divisible_by,
                               args.parallel.tensor_model_parallel_size)
    schedule = resolve_schedule(args, train_samples_per_epoch(args.data.data_path, args.data.split,
                                                              args.model.seq_length))
    config = model_config(args, padded, dist_info)
    engine, ds_config = setup_engine_for(args, config, dist_info, schedule.train_iters)
    state, rng = LoopState(), None
    if args.checkpoint.load:
        state.iteration, state.consumed_samples, rng = load_checkpoint(engine, args)
    reporter = build_reporter(args, dist_info, schedule, config, ds_config)
    train_iter, valid_iter = build_data_iterators(args, dist_info, schedule.train_iters, state.iteration,
                                                 state.consumed_samples)
    if rng is not None:
        set_rng_state(rng, engine.module)
    state = train(engine, train_iter, valid_iter, args, dist_info, reporter, tokenizer.eod, state,
                  **step_functions(args))
    if args.checkpoint.save:
        save(engine, args, state, dist_info)
    if state.iteration >= schedule.train_iters:
        reporter.print_line(training_done_line())
    reporter.close()
    return state


def setup_engine_for(args: Args, config, dist_info: DistInfo, train_iters: int):
    from megatron.deepspeed_config import write_deepspeed_config
    from megatron.run_record import write_environment_record
    from megatron.model import GPTModel, accounting
    from megatron.training import setup_engine

    parallel = ParallelState.build(parallel_layout(args))
    if args.parallel.pipeline_model_parallel_size > 1:
        from megatron.model.gpt_model_pipe import build_gpt_pipe
        builder = partial(build_gpt_pipe, config, parallel)
    else:
        builder = partial(GPTModel, config, parallel.get_tensor_model_parallel_group())
    engine, ds_config = setup_engine(builder, accounting.count_parameters(config), args, dist_info, train_iters,
                                     parallel)
    if args.deepspeed.run_dir and dist_info.rank == 0:
        write_deepspeed_config(ds_config, args.deepspeed.run_dir)
        write_environment_record(args.deepspeed.run_dir, dist_info)
    return engine, ds_config


def project_errors() -> tuple[type[Exception], ...]:
    """The error types whose messages already name the flag/file; anything else is a bug and keeps its traceback."""
    from megatron.data.gpt_dataset import DatasetError
    from megatron.data.indexed_dataset import IndexedDatasetError
    from megatron.dist_env import DistEnvError
    from megatron.model.config import ModelConfigError
    from megatron.inference.checkpoint import CheckpointError
    from megatron.tokenizer import TokenizerError
    return (ConfigError, TrainingError, DatasetError, IndexedDatasetError, DistEnvError, ModelConfigError,
            TokenizerError, CheckpointError)


def main(argv: list[str]) -> int:
    try:
        from deepspeed.accelerator import get_accelerator
        args = parse_args(argv, launcher_world_size(), get_accelerator().device_name())
        pretrain(args, initialize_distributed())
    except project_errors() as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 1
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
