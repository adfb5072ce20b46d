"""Saving a training checkpoint through the DeepSpeed engine, and resuming one (docs/checkpoints.md).

A save follows megatron/checkpointing/protocol.py: every rank writes its files through DeepSpeed into
`<tag>.saving` and fsyncs each one (DeepSpeed's own `latest` is switched off: rank 0 would write it
as soon as its own files are done, before the other ranks' are); after a barrier rank 0 writes the
marker and swaps the folder into place, then `latest`. The marker carries the manifest: each rank's files
with the CRC-32 its checkpoint engine took while writing them (writer.py), gathered to rank 0. A resume
takes the checkpoint protocol.resume_tag picks, rank 0 reading every file back against the manifest and
skipping a damaged checkpoint for the newest intact one before it. Every torch.load of a resume is
restricted (megatron/safe_load.py).
"""
from __future__ import annotations

import os
import time
from dataclasses import asdict
from typing import TYPE_CHECKING

import torch.distributed as dist
from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

from megatron.checkpointing import protocol
from megatron.checkpointing.protocol import CheckpointError
from megatron.checkpointing.resume_check import check_layout, current_layout
from megatron.checkpointing.rng import own_rng_state, rng_state, save_own_rng_state
from megatron.checkpointing.writer import FlushingCheckpointEngine
from megatron.safe_load import restricted_unpickling

if TYPE_CHECKING:
    from megatron.arguments import Args


def save_checkpoint(engine, args: Args, iteration: int, consumed_samples: int, rank: int,
                    consumed_tokens: int | None = None) -> float:
    """Returns the seconds the save took on this rank, from the first barrier to the commit's (every rank's
    files written, flushed and swapped into place), the time a checkpoint interval is weighed against
    (--async-save saves through megatron/checkpointing/async_save.py instead).
    consumed_tokens: the tokens trained on so far (a curriculum's steps are shorter than --seq-length); None:
    consumed_samples x --seq-length."""
    save_dir, tag = args.checkpoint.save, protocol.tag_name(iteration)
    started = time.perf_counter()
    if type(engine.checkpoint_engine) is TorchCheckpointEngine:  # DeepSpeed's default engine (not a user's)
        engine.checkpoint_engine = FlushingCheckpointEngine(engine._config)
    previous = write_staged(engine, args, iteration, consumed_samples, rank, consumed_tokens)
    # every rank's files are written and flushed once this collective returns; rank 0 gets their CRC-32s
    checksums = _gather_checksums(engine, os.path.join(save_dir, protocol.staging_tag(tag)))
    if rank == 0:
        protocol.commit(save_dir, tag, commit_record(args, iteration, consumed_samples), checksums=checksums)
    dist.barrier()  # no rank reports the save before it is committed
    seconds = time.perf_counter() - started
    if rank == 0:
        print(saved_line(save_dir, tag, iteration, seconds), flush=True)
    return seconds


def saved_line(save_dir: str, tag: str, iteration: int, seconds: float) -> str:
    size = sum(protocol.listed_files(os.path.join(save_dir, tag)).values())
    return (f"  successfully saved checkpoint at iteration {iteration:8d} to {save_dir} "
            f"in {seconds:.2f} s ({size / 1e6:.1f} MB)")


def commit_record(args: Args, iteration: int, consumed_samples: int) -> dict:
    """What the marker records besides the files."""
    return {"iteration": iteration, "consumed_samples": consumed_samples, "argv": args.argv,
            "layout": current_layout(args)}


def failed_line(save_dir: str, tag: str, rank: int, why: str, previous: str | None) -> str:
    kept = f"'latest' still names {previous}" if previous else "no checkpoint is complete there yet"
    return f"--save {save_dir}: writing checkpoint {tag} failed on rank {rank} ({why}); {kept}"


def write_staged(engine, args: Args, iteration: int, consumed_samples: int, rank: int,
                 consumed_tokens: int | None) -> str | None:
    """Every rank hands DeepSpeed's files of this save to its checkpoint engine, into `<tag>.saving`
    (written there, or with --async-save copied to host memory to be written); returns the tag `latest`
    named before."""
    save_dir, tag = args.checkpoint.save, protocol.tag_name(iteration)
    previous = protocol.read_latest(save_dir)
    if rank == 0:
        protocol.prepare_save(save_dir, tag)
    dist.barrier()  # no rank writes before an interrupted save's leftovers are gone
    generators = rng_state(engine.module)
    if consumed_tokens is None:
        consumed_tokens = consumed_samples * args.model.seq_length
    client_state = {"iteration": iteration, "consumed_samples": consumed_samples, "consumed_tokens": consumed_tokens,
                    "rng_state": generators, "args": asdict(args),
                    # the model shape and layout in the one form megatron/saved_model reads back
                    "model_config": args.model.to_dict(),
                    "tensor_model_parallel_size": args.parallel.tensor_model_parallel_size}
    if hasattr(engine.checkpoint_engine, "start_manifest"):
        engine.checkpoint_engine.start_manifest()
    try:
        engine.save_checkpoint(save_dir, tag=protocol.staging_tag(tag), client_state=client_state,
                               save_latest=False)
        # DeepSpeed keeps one rank's client state at ZeRO 0-2; every rank's generators are its own
        save_own_rng_state(engine.checkpoint_engine, os.path.join(save_dir, protocol.staging_tag(tag)), rank,
                           generators)
    except OSError as err:  # a full disk, a file-size limit, a vanished folder
        raise CheckpointError(failed_line(save_dir, tag, rank, err.strerror or str(err), previous)) from None
    return previous


def _gather_checksums(engine, staging: str) -> dict[str, str] | None:
    """Every rank's files of this save with the CRC-32 its checkpoint engine took while writing them, by
    path relative to the staging folder (rank 0; None elsewhere, and where no engine took any: a user's
    own checkpoint engine, or FlushingCheckpointEngine(checksums=False))."""
    written = getattr(engine.checkpoint_engine, "written", {})
    mine = {os.path.relpath(path, staging): crc for path, (_, crc) in written.items() if crc is not None}
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    merged = {name: crc for part in parts for name, crc in part.items()}
    return (merged or None) if dist.get_rank() == 0 else None


def _agreed_tag(args: Args) -> str | None:
    """The tag every rank resumes, as rank 0 chooses it by the resume rule with every file's contents
    checked against the checksums saved with it (again since start-up, which checked sizes only: on a
    cluster filesystem another host may see the folder a moment later); None: start afresh. Rank 0 says
    which checkpoint it skipped and why; a checkpoint rank 0 refuses is refused by every rank, in one line."""
    load_dir = args.checkpoint.load
    found = [None]
    if dist.get_rank() == 0:
        try:
            found = [("tag", _choose(args) if protocol.read_latest(load_dir) else None)]
        except CheckpointError as err:
            found = [("error", str(err))]
    dist.broadcast_object_list(found, src=0)
    kind, value = found[0]
    if kind == "error":
        raise CheckpointError(value)
    return value


def _choose(args: Args) -> str:
    load_dir = args.checkpoint.load
    choice = protocol.resume_tag(load_dir, contents=True)
    for line in choice.skip_lines():
        print(line, flush=True)
    if not protocol.has_checksums(os.path.join(load_dir, choice.tag)):
        print(f"note: --load {load_dir}: {choice.tag} has no checksums (saved before zero-lab wrote them, or "
              "through another checkpoint engine): its files' sizes were checked, their contents cannot be",
              flush=True)
    check_layout(args, choice.tag)  # a checkpoint before a skipped one may have another layout
    return choice.tag


def load_checkpoint(engine, args: Args) -> tuple[int, int, int, dict | None]:
    """Returns (iteration, consumed_samples, consumed_tokens, RNG states); with --finetune only the weights are
    taken, and without a checkpoint in --load nothing (a fresh start). --no-load-optim leaves the optimizer states
    and the schedule, --no-load-rng the random generators (None), where the run started them.
    The caller restores the RNG states with set_rng_state as the last thing before training: creating
    a DataLoader iterator draws from torch's RNG, so restoring earlier would not continue the run exactly."""
    ckpt = args.checkpoint
    if ckpt.finetune:
        # weights only, from a checkpoint of any ZeRO stage or tools/hf_to_checkpoint.py (DeepSpeed's
        # loader needs the same partitioning as the run); iteration, optimizer and schedule start afresh
        from megatron.checkpointing.finetune import load_finetune_weights
        path, notes = load_finetune_weights(engine, ckpt.load, trust=ckpt.trust_checkpoint, config=args.model)
        if dist.get_rank() == 0:
            print(f"  loaded weights from {path} for fine-tuning (iteration and optimizer reset)", flush=True)
            for note in notes:
                print(note, flush=True)
        return 0, 0, 0, None
    tag = _agreed_tag(args)
    if tag is None:
        if dist.get_rank() == 0:
            print(f" > no checkpoint in --load {ckpt.load} (no 'latest' file): starting from scratch", flush=True)
        return 0, 0, 0, None
    if ckpt.universal_checkpoint:
        from megatron.checkpointing.universal import load_universal
        path, client_state = load_universal(engine, args, tag)
    else:
        # --no-load-optim: Megatron's meaning, the optimizer states and the learning-rate schedule start afresh
        with restricted_unpickling(ckpt.trust_checkpoint, os.path.join(ckpt.load, tag)):
            path, client_state = engine.load_checkpoint(ckpt.load, tag=tag,
                                                        load_optimizer_states=not ckpt.no_load_optim,
                                                        load_lr_scheduler_states=not ckpt.no_load_optim)
    if path is None:
        raise CheckpointError(f"--load {ckpt.load}: DeepSpeed found no loadable checkpoint in {tag}")
    if dist.get_rank() == 0:
        print(f"  loaded checkpoint {path} at iteration {client_state['iteration']}", flush=True)
        note = getattr(engine.lr_scheduler, "resume_note", None)  # the flags change the saved schedule
        if note:
            print(note, flush=True)
    generators = None if ckpt.no_load_rng else own_rng_state(os.path.join(ckpt.load, tag), dist.get_rank(),
                                                             client_state, ckpt.trust_checkpoint)
    samples = client_state["consumed_samples"]
    # a checkpoint saved before zero-lab counted tokens: every step of it was whole
    tokens = client_state.get("consumed_tokens", samples * args.model.seq_length)
    return client_state["iteration"], samples, tokens, generators
