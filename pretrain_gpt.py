"""Pretrain a GPT with DeepSpeed: `python pretrain_gpt.py <Megatron-DeepSpeed flags>` under a launcher
(deepspeed, torchrun, mpiexec, srun). Parse the flags, check the run's files (megatron/startup.py: data,
tokenizer, outputs, the checkpoint to resume), then datasets, model, train."""
import gc
import os
import sys
import time
from dataclasses import replace
from datetime import timedelta
from functools import partial

import torch

from megatron.accounting.measure import comm_counter
from megatron.arguments import Args, parse_args
from megatron.core.parallel_state import ParallelState
from megatron.errors import ZeroLabError
from megatron.initialize import DistInfo, initialize_distributed, launcher_world_size, set_seed, silence_known_warnings
from megatron.flag_sources import name_sources
from megatron.runtime.heartbeat import Heartbeat, silent_seconds
from megatron.runtime.lost_peer import Peers
from megatron.startup import check_save_folder_is_shared, prepare_run
from megatron.loop_state import LoopState, resolve_schedule

# Launchers stop every rank as soon as one fails; a rank other than 0 on rank 0's host waits this long before
# printing its error, so that an error every rank hits is printed once, by rank 0, and one only it hits still
# shows. Ranks on the other hosts print at once: their host's launcher would stop them before the wait ends.
ERROR_GRACE_SECONDS = 10.0


def build_data_iterators(args: Args, dist_info: DistInfo, train_iters: int, iteration: int, consumed_samples: int):
    """Train and validation iterators positioned where a run at `iteration` left them (as Megatron does,
    the validation stream continues across evaluations, so a resumed run sees the same validation batches)."""
    from megatron.data.data_samplers import build_pretraining_data_loader, loader_workers
    from megatron.data.gpt_dataset import build_train_valid_test_datasets

    batch, log = args.training.global_batch_size, args.logging
    # a run resumed with another global batch (on fewer hosts, say) reads on from where the samples it
    # consumed end; the test split is never evaluated during pretraining, so no test samples are asked for
    train_samples = max(train_iters * batch, consumed_samples + (train_iters - iteration) * batch)
    wanted = (train_samples, train_iters // log.eval_interval * log.eval_iters * batch, 0)
    train_ds, valid_ds, _ = build_train_valid_test_datasets(args.data.data_path, args.data.split, wanted,
                                                             args.model.seq_length, args.training.seed,
                                                             args.data.data_cache_path)
    valid_consumed = iteration // log.eval_interval * log.eval_iters * batch
    # tensor-, pipeline- and sequence-parallel ranks of one replica read the same data
    data_group = dist_info.parallel.data
    workers = loader_workers(args.data.num_workers, dist_info.on_cuda)
    loaders = [build_pretraining_data_loader(ds, consumed, args.training.micro_batch_size, data_group.rank,
                                             data_group.size, num_workers=workers, pin_memory=dist_info.on_cuda)
               for ds, consumed in ((train_ds, consumed_samples), (valid_ds, valid_consumed))]
    return [None if loader is None else iter(loader) for loader in loaders]


def step_functions(args: Args) -> dict:
    """With pipeline parallelism DeepSpeed's pipeline engine runs the micro-batches (train_batch)."""
    if args.parallel.pipeline_model_parallel_size == 1:
        return {}
    from megatron.pipeline_training import pipeline_evaluate, pipeline_train_step
    return dict(step_fn=pipeline_train_step, evaluate_fn=pipeline_evaluate)


def pretrain(args: Args, tokenizer, dist_info: DistInfo, comm=None) -> LoopState:
    from megatron.checkpointing.rng import set_rng_state
    from megatron.checkpointing.save_load import load_checkpoint
    from megatron.data.dataset_sidecar import check_data_against_model
    from megatron.data.gpt_dataset import train_samples_per_epoch
    from megatron.accounting.report import build_reporter
    from megatron.training import save, train, trainer_steps
    from megatron.training_log import training_done_line

    set_seed(args.training.seed)
    # every dataset of the blend against the model's vocabulary, before any time is spent (docs/bad-input.md)
    for warning in check_data_against_model(args.data.data_path, args.data, tokenizer.vocab_size,
                                            args.model.padded_vocab_size, args.data.allow_tokenizer_mismatch):
        if dist_info.rank == 0:
            print(f"warning: {warning}", flush=True)
    schedule = resolve_schedule(args, train_samples_per_epoch(args.data.data_path, args.data.split,
                                                              args.model.seq_length))
    engine, ds_config = setup_engine_for(args, dist_info, schedule.train_iters)
    state, rng = LoopState(), None
    if args.checkpoint.load:
        state.iteration, state.consumed_samples, state.consumed_tokens, rng = load_checkpoint(engine, args)
        if not args.checkpoint.finetune:
            state.last_saved_iteration = state.iteration  # a resumed run that is already done saves nothing again
    reporter = build_reporter(args, dist_info, schedule, ds_config, trainer_steps(), comm, engine)
    train_iter, valid_iter = build_data_iterators(args, dist_info, schedule.train_iters, state.iteration,
                                                 state.consumed_samples)
    if rng is not None:
        set_rng_state(rng, engine.module)
    state = train(engine, train_iter, valid_iter, args, dist_info, reporter, tokenizer.eod, state,
                  **step_functions(args))
    if args.checkpoint.save:
        save(engine, args, state, dist_info, reporter, final="the run ends")
    if schedule.finished(state):
        reporter.print_line(training_done_line())
    reporter.close()
    return state


def setup_engine_for(args: Args, dist_info: DistInfo, train_iters: int):
    from megatron.deepspeed_config import tuned_keys_added, write_deepspeed_config
    from megatron.training_log import tuned_keys_line
    from megatron.model import GPTModel
    from megatron import accounting
    from megatron.model.moe import expert_rank
    from megatron.run_record import write_environment_record
    from megatron.engine import setup_engine

    parallel = dist_info.parallel
    if args.parallel.pipeline_model_parallel_size > 1:
        from megatron.model.gpt_model_pipe import build_gpt_pipe
        builder = partial(build_gpt_pipe, args.model, parallel)
    else:
        builder = partial(GPTModel, args.model, parallel.get_tensor_model_parallel_group(),
                          parallel.get_sequence_parallel_group(),
                          expert_rank=expert_rank(args.model, parallel.data.rank))
    engine, ds_config = setup_engine(builder, accounting.count_parameters(args.model), args, dist_info, train_iters)
    user = args.deepspeed.user_config
    if user is not None and dist_info.rank == 0 and (added := tuned_keys_added(user, ds_config)):
        print(tuned_keys_line(args.deepspeed.deepspeed_config, added), flush=True)
    if args.deepspeed.run_dir and dist_info.rank == 0:
        write_deepspeed_config(ds_config, args.deepspeed.run_dir)
        write_environment_record(args.deepspeed.run_dir, dist_info)
    return engine, ds_config


def report_error(message: str, argv: list[str]) -> None:
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if rank != 0 and rank == local_rank:  # ranks are placed host by host: rank == local rank on rank 0's host
        time.sleep(ERROR_GRACE_SECONDS)
    # a launch script's flag is named with the variable it came from (megatron/flag_sources.py)
    print(f"error: {name_sources(message, argv)}", file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    silence_known_warnings()
    # The modules imported so far (torch, DeepSpeed: a few hundred thousand objects) live as long as the process:
    # frozen, the collector no longer walks them, at each full collection and at each CPU memory sample
    # (megatron/accounting/measure/memory.py's live_tensor_bytes reads gc.get_objects(), which leaves frozen objects
    # out). The run's
    # own tensors are all made after this point, so every one of them is still counted.
    gc.freeze()
    peers, heartbeat, finished = None, None, False
    try:
        from deepspeed.accelerator import get_accelerator
        args = parse_args(argv, launcher_world_size(), get_accelerator().device_name())
        args, tokenizer = prepare_run(args, verbose=int(os.environ.get("RANK", "0")) == 0)
        # before DeepSpeed starts: every collective of the run goes through the counter (docs/zero-tradeoff.md)
        comm = comm_counter.install()
        dist_info = initialize_distributed(args.parallel.distributed_timeout_minutes)
        if dist_info.on_cuda:  # time what the compute stream waits for with CUDA events (comm_counter.py)
            comm.time_on_cuda(torch.cuda.current_stream())
        peers = Peers.gather(dist_info.address)  # who runs where: a lost host is then named
        check_save_folder_is_shared(args.checkpoint.save)  # every host's ranks must write into the same folder
        # a silent host ends the job in a minute (megatron/runtime/heartbeat.py)
        heartbeat = Heartbeat(peers, silent_seconds()).start()
        # the layout's process groups, built once; the data loader, the logging rank and DeepSpeed's mpu use them
        timeout = timedelta(minutes=args.parallel.distributed_timeout_minutes)
        pretrain(args, tokenizer, replace(dist_info, parallel=ParallelState.build(args.parallel.layout, timeout)), comm)
        finished = True
    except ZeroLabError as err:
        report_error(str(err), argv)
        return 1
    except Exception as err:  # a collective that failed because a host is gone is the user's to act on
        if peers is None or not Peers.is_lost_peer(err):
            raise
        report_error(peers.describe(err, args.parallel.distributed_timeout_minutes), argv)
        return 1
    finally:
        if heartbeat is not None:  # its threads end before Python does, on every way out (heartbeat.py)
            heartbeat.stop(finished)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
