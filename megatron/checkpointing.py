"""Training checkpoints: DeepSpeed's engine files plus our client state, committed atomically.

A save is committed in this order (docs/checkpoints.md):
1. rank 0 deletes the tag's folder if it exists (a re-used run folder), so a tag being overwritten
   never looks complete (its marker `zero_lab_state.json` is gone) nor keeps files of another layout;
2. every rank writes its files through DeepSpeed and fsyncs each one (FlushingCheckpointEngine);
3. all ranks meet at a barrier; then rank 0 writes the marker, listing every file with its size,
   and only then `latest` (temporary name + rename). DeepSpeed's own `latest` is switched off: it is
   written by rank 0 as soon as rank 0's own files are done, before the other ranks' files are.
A save interrupted anywhere (SIGTERM, SIGKILL, a full disk) leaves `latest` naming the previous
complete checkpoint. A resume checks the named checkpoint against its marker first
(`check_resumable`); every torch.load of the resume is restricted (megatron/safe_load.py).
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import asdict
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

from megatron.errors import ZeroLabError
from megatron.safe_load import restricted_unpickling

if TYPE_CHECKING:
    from megatron.arguments import Args

MARKER = "zero_lab_state.json"
_TAG = re.compile(r"^global_step(\d+)$")


class CheckpointError(ZeroLabError, RuntimeError):
    """A checkpoint cannot be saved or resumed; the message names the file and what to do."""


def rng_state(module: torch.nn.Module) -> dict:
    """Every generator dropout can draw from, including the model's tensor-parallel tracker, as
    tensors and plain types only (so a weights_only load needs no numpy types allowed)."""
    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss),
                       float(cached_gaussian)]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    tracker = getattr(module, "rng_tracker", None)
    if tracker is not None:
        state["model_parallel_tracker"] = tracker.get_states()
    return state


def set_rng_state(state: dict, module: torch.nn.Module) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.int64).astype(np.uint32), pos, has_gauss,
                         cached_gaussian))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    tracker = getattr(module, "rng_tracker", None)
    if tracker is not None and "model_parallel_tracker" in state:
        tracker.set_states(state["model_parallel_tracker"])


def _tag(iteration: int) -> str:
    return f"global_step{iteration}"


class FlushingCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's torch.save engine, writing through a Python file so that (1) each file is fsynced
    before the barrier after which the marker vouches for it, and (2) a failed write reports its OS
    error (torch's zip writer says only "unexpected pos ..." when the disk is full)."""

    def save(self, state_dict, path: str):
        with open(path, "wb") as handle:
            writer = _RecordingWriter(handle)
            try:
                torch.save(state_dict, writer, _use_new_zipfile_serialization=self.zipfile_serialization)
            except RuntimeError:
                if writer.error is not None:
                    raise writer.error from None
                raise
            handle.flush()
            os.fsync(handle.fileno())


class _RecordingWriter:
    """A file's write and flush that remember the OSError torch's writer swallows."""

    def __init__(self, handle):
        self.handle, self.error = handle, None

    def write(self, data) -> int:
        try:
            return self.handle.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self):
        self.handle.flush()


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    _fsync(os.path.dirname(path) or ".")  # the rename itself is durable only once the folder is flushed


def read_latest(load_dir: str) -> str | None:
    path = os.path.join(load_dir, "latest")
    if not os.path.isfile(path):
        return None
    with open(path) as handle:
        return handle.read().strip()


def save_checkpoint(engine, args: Args, iteration: int, consumed_samples: int, rank: int) -> None:
    save_dir, tag = args.checkpoint.save, _tag(iteration)
    folder = os.path.join(save_dir, tag)
    if type(engine.checkpoint_engine) is TorchCheckpointEngine:  # DeepSpeed's default engine (not a user's)
        engine.checkpoint_engine = FlushingCheckpointEngine(engine._config)
    previous = read_latest(save_dir)
    if rank == 0 and os.path.isdir(folder):
        # a re-used run folder: the old files of this tag go first, marker included, so that the tag never
        # looks complete mid-write nor keeps files of another layout (e.g. a second rank's optimizer shard)
        shutil.rmtree(folder)
    dist.barrier()  # no rank writes into the tag before the old one is gone
    client_state = {"iteration": iteration, "consumed_samples": consumed_samples,
                    "rng_state": rng_state(engine.module), "args": asdict(args),
                    # the model shape and layout in the one form megatron/saved_model reads back
                    "model_config": args.model.to_dict(),
                    "tensor_model_parallel_size": args.parallel.tensor_model_parallel_size}
    try:
        engine.save_checkpoint(save_dir, tag=tag, client_state=client_state, save_latest=False)
    except OSError as err:  # a full disk, a file-size limit, a vanished folder
        kept = f"'latest' still names {previous}" if previous else "no checkpoint is complete there yet"
        raise CheckpointError(f"--save {save_dir}: writing checkpoint {tag} failed on rank {rank} "
                              f"({err.strerror or err}); {kept}") from None
    dist.barrier()  # every rank's files are written and flushed
    if rank == 0:
        files = {name: os.path.getsize(os.path.join(folder, name)) for name in sorted(os.listdir(folder))
                 if name != MARKER and os.path.isfile(os.path.join(folder, name))}
        _write_atomic(os.path.join(folder, MARKER), json.dumps(
            {"iteration": iteration, "consumed_samples": consumed_samples, "argv": args.argv,
             "layout": saved_layout(args), "files": files}, indent=2))
        _write_atomic(os.path.join(save_dir, "latest"), tag)
    print(f"  successfully saved checkpoint at iteration {iteration:8d} to {save_dir}", flush=True)


def saved_layout(args: Args) -> dict:
    """What a resume must match to load the files as they are (else --universal-checkpoint)."""
    par = args.parallel
    return {"zero_stage": args.deepspeed.zero_stage, "data_parallel_size": par.data_parallel_size,
            "tensor_model_parallel_size": par.tensor_model_parallel_size,
            "pipeline_model_parallel_size": par.pipeline_model_parallel_size}


def read_marker(folder: str) -> dict:
    with open(os.path.join(folder, MARKER)) as handle:
        return json.load(handle)


def incomplete_reason(folder: str) -> str | None:
    """Why the checkpoint in `folder` is not complete, naming the bad file; None when it is."""
    if not os.path.isdir(folder):
        return "its folder does not exist"
    marker = os.path.join(folder, MARKER)
    if not os.path.isfile(marker):
        empty = [name for name in sorted(os.listdir(folder)) if os.path.getsize(os.path.join(folder, name)) == 0]
        return (f"{MARKER} is missing, so its save never finished"
                + (f" ({empty[0]} is 0 bytes)" if empty else ""))
    try:
        files = read_marker(folder).get("files")
    except (OSError, json.JSONDecodeError, AttributeError) as err:
        return f"{MARKER} is unreadable ({err})"
    if files is None:
        return None  # written before markers listed the files: nothing to check against
    for name, size in files.items():
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            return f"{name} is missing"
        if os.path.getsize(path) != size:
            return f"{name} is {os.path.getsize(path)} bytes, {size} when it was saved"
    return None


def intact_tags(load_dir: str) -> list[str]:
    """The complete checkpoints under load_dir, newest first."""
    steps = sorted((int(m.group(1)) for m in map(_TAG.match, os.listdir(load_dir)) if m), reverse=True)
    return [_tag(step) for step in steps if incomplete_reason(os.path.join(load_dir, _tag(step))) is None]


def check_resumable(load_dir: str) -> str:
    """The tag `latest` names, once its files are checked; a CheckpointError (one line naming the bad
    file and the newest intact checkpoint) otherwise."""
    tag = read_latest(load_dir)
    if not tag:
        raise CheckpointError(f"--load {load_dir} holds no checkpoint (no 'latest' file there)")
    reason = incomplete_reason(os.path.join(load_dir, tag))
    if reason is None:
        return tag
    intact = [other for other in intact_tags(load_dir) if other != tag]
    hint = (f"the newest intact checkpoint is {intact[0]} (to resume from it: echo {intact[0]} > "
            f"{os.path.join(load_dir, 'latest')})" if intact else
            "no intact checkpoint is left there (a tools/hf_to_checkpoint.py folder is loaded with --finetune)")
    raise CheckpointError(f"--load {load_dir}: checkpoint {tag} named by 'latest' is incomplete: {reason}; {hint}")


def load_checkpoint(engine, args: Args) -> tuple[int, int, dict | None]:
    """Returns (iteration, consumed_samples, RNG states); with --finetune only the weights are taken.
    The caller restores the RNG states with set_rng_state as the last thing before training: creating
    a DataLoader iterator draws from torch's RNG, so restoring earlier would not continue the run exactly."""
    ckpt = args.checkpoint
    if ckpt.finetune:
        # weights only, from a checkpoint of any ZeRO stage or tools/hf_to_checkpoint.py (DeepSpeed's
        # loader needs the same partitioning as the run); iteration, optimizer and schedule start afresh
        from megatron.finetune import load_finetune_weights
        path = load_finetune_weights(engine, ckpt.load, trust=ckpt.trust_checkpoint)
        print(f"  loaded weights from {path} for fine-tuning (iteration and optimizer reset)", flush=True)
        return 0, 0, None
    tag = check_resumable(ckpt.load)  # again: the folder may have changed since start-up
    if ckpt.universal_checkpoint:
        from megatron.universal_checkpoint import load_universal
        path, client_state = load_universal(engine, args, tag)
    else:
        with restricted_unpickling(ckpt.trust_checkpoint, os.path.join(ckpt.load, tag)):
            path, client_state = engine.load_checkpoint(ckpt.load, tag=tag)
    if path is None:
        raise CheckpointError(f"--load {ckpt.load}: DeepSpeed found no loadable checkpoint in {tag}")
    print(f"  loaded checkpoint {path} at iteration {client_state['iteration']}", flush=True)
    return client_state["iteration"], client_state["consumed_samples"], client_state["rng_state"]
