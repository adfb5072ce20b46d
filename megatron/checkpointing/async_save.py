"""--async-save: a save that copies the state to host memory and writes it while training goes on
(docs/checkpoints.md, "--async-save").

Training waits only while DeepSpeed builds its state dicts (its barriers and tag check included) and each rank
copies every tensor of them into host memory of its own (`HostCopyEngine.save`): the steps that follow change the
weights and optimizer states in place, never the copy. A thread of each rank then writes the copy as a synchronous
save would, through FlushingCheckpointEngine (each file fsynced, its CRC-32 taken) into `<tag>.saving`; the ranks'
writers meet on a gloo group of their own (objects only, beside the training's collectives) to exchange their
outcomes and checksums, and rank 0 commits (protocol.commit: the marker with the manifest last, then `latest`).
A write that fails on any rank, or a rank that dies, commits nothing: `latest` keeps naming the previous
checkpoint, which the next start resumes.

A save waits for the write before it (one line); the run's end, SIGTERM's save and --exit-duration-in-mins's wait for
the last one (`finish`), and a failed write ends the run there in one line, as a synchronous save's would.

Why not DeepSpeed 0.19.8's engines: its DecoupledCheckpointEngine hands the live tensors (no copy) to a spawned
process through torch.multiprocessing and waits for them before the next optimizer step, so the write overlaps one
forward and backward only; its FastCheckpointEngine writes through its own file writers; neither fsyncs or
checksums a file, and rank 0 writes `latest` once its own process is done, before the other ranks' files are.
PyTorch DCP's async_save writes DCP's own files (`.distcp`), not ZeRO's that the resume, the universal conversion,
tools/ and megatron/saved_model read. This engine keeps DeepSpeed's own file layout: it takes the state dicts
DeepSpeed gives its checkpoint engine, as DeepSpeed's engines do.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

from megatron.checkpointing import protocol
from megatron.checkpointing.protocol import CheckpointError
from megatron.checkpointing.rng import rng_state
from megatron.checkpointing.save_load import commit_record, failed_line, saved_line, write_staged
from megatron.checkpointing.writer import FlushingCheckpointEngine

if TYPE_CHECKING:
    from megatron.arguments import Args


def host_copy(state, spare: dict[tuple, list[torch.Tensor]] | None = None):
    """(`state` with every tensor copied to host memory of its own, the copies). Containers are rebuilt, other
    values kept (DeepSpeed's state dicts hold plain types); a tensor met twice (tied weights) is copied once. A copy
    goes into a buffer of `spare` (by dtype and shape) where one is left from an earlier save: writing into memory
    already touched is ~3x faster than into fresh pages (24 against 77 ms for 144 MB here)."""
    copies: dict[tuple, torch.Tensor] = {}
    spare = {} if spare is None else spare

    def copy(value):
        if isinstance(value, torch.Tensor):
            key = _tensor_key(value)
            if key not in copies:
                free = spare.get(_buffer_key(value))
                target = free.pop() if free else torch.empty(value.shape, dtype=value.dtype, device="cpu")
                copies[key] = target.copy_(value.detach())
            return copies[key]
        if isinstance(value, dict):
            rebuilt = value.copy()  # keeps the type (OrderedDict, defaultdict)
            for name, item in value.items():
                rebuilt[name] = copy(item)
            return rebuilt
        if isinstance(value, list):
            return [copy(item) for item in value]
        if isinstance(value, tuple):
            items = [copy(item) for item in value]
            return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
        return value

    return copy(state), list(copies.values())


def _buffer_key(tensor: torch.Tensor) -> tuple:
    return tensor.dtype, tuple(tensor.shape)


def _tensor_key(tensor: torch.Tensor) -> tuple:
    """What makes two tensors of a state one copy: the same memory seen the same way (tied weights)."""
    return tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride()


def state_bytes(state) -> int:
    """The bytes host_copy would copy of `state`: each distinct tensor's elements, once."""
    seen: dict[tuple, int] = {}

    def walk(value):
        if isinstance(value, torch.Tensor):
            seen[_tensor_key(value)] = value.numel() * value.element_size()
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)

    walk(state)
    return sum(seen.values())


def copy_bytes(engine) -> int:
    """The bytes this rank's --async-save copy takes (HostCopyEngine.host_bytes), sized without copying from the
    state dicts a save hands the checkpoint engine, each file's copied on its own: where the rank writes the
    model-states file (DeepSpeed's save_non_zero_checkpoint: data-parallel rank 0, every rank at ZeRO-3) the
    module's state dict with the client state's generators, and at ZeRO-0 the optimizer's; where it writes a ZeRO
    file (save_zero_checkpoint) the optimizer's; and the generators again in the rank's own file (rng.py). The
    copy stays allocated from the first save to the run's end (HostCopyEngine keeps its buffers for the next)."""
    generators = rng_state(engine.module)
    total = state_bytes(generators)
    if engine.save_non_zero_checkpoint:
        total += state_bytes(engine.module.state_dict()) + state_bytes(generators)
        if not engine.zero_optimization():
            total += state_bytes(engine.optimizer.state_dict())
    if engine.save_zero_checkpoint:
        total += state_bytes(engine.optimizer.state_dict())
    return total


class HostCopyEngine(FlushingCheckpointEngine):
    """DeepSpeed's checkpoint engine for --async-save: `save` keeps a host copy of each file's state dict,
    `write_queued` (the writer thread) writes them as FlushingCheckpointEngine does. The copies' buffers are
    kept for the next save's copy (`spare`): one host copy of the rank's checkpoint stays allocated."""

    def __init__(self, config_params=None):
        super().__init__(config_params)
        self.queued: list[tuple[object, str, list[torch.Tensor]]] = []
        self.spare: dict[tuple, list[torch.Tensor]] = {}
        self.host_bytes = 0
        self.saves = BackgroundSaves()

    def start_manifest(self) -> None:
        super().start_manifest()
        self.queued, self.host_bytes = [], 0

    def save(self, state_dict, path: str):
        copied, buffers = host_copy(state_dict, self.spare)
        self.queued.append((copied, path, buffers))
        self.host_bytes += sum(buffer.untyped_storage().nbytes() for buffer in buffers)

    def preserves_storage_sharing(self) -> bool:
        return False  # DeepSpeed need not clone what host_copy copies compactly anyway

    def write_queued(self) -> None:
        """Write every queued copy; its buffers go back to `spare` once written (the main thread takes them only
        after waiting for this write)."""
        queued, self.queued = self.queued, []
        try:
            for state, path, _ in queued:
                FlushingCheckpointEngine.save(self, state, path)
        finally:
            for _, _, buffers in queued:
                for buffer in buffers:
                    self.spare.setdefault(_buffer_key(buffer), []).append(buffer)


@dataclass
class Write:
    """One checkpoint being written in the background, and how it ended (error: the one-line reason)."""
    save_dir: str
    tag: str
    iteration: int
    record: dict
    previous: str | None
    started: float
    blocked: float = 0.0
    host_bytes: int = 0
    error: str | None = None
    thread: threading.Thread | None = field(default=None, repr=False)


class BackgroundSaves:
    """The one write in flight on this rank, and the gloo group the ranks' writers meet on."""

    def __init__(self):
        self.group = None
        self.current: Write | None = None

    def start(self, engine: HostCopyEngine, write: Write) -> None:
        if self.group is None:  # every rank's main thread gets here at the same save: the groups match
            self.group = dist.new_group(backend="gloo")
        write.thread = threading.Thread(target=_write_and_commit, args=(engine, self.group, write),
                                        name=f"async-save-{write.tag}")
        self.current = write
        write.thread.start()

    def wait(self, before: str) -> float:
        """Wait for the write in flight, if any; one line from rank 0 when it was still running. A write that
        failed raises its one line (CheckpointError). Returns the seconds waited."""
        write, self.current = self.current, None
        if write is None:
            return 0.0
        waited = 0.0
        if write.thread.is_alive():
            started = time.perf_counter()
            write.thread.join()
            waited = time.perf_counter() - started
            if dist.get_rank() == 0:
                print(f"  waited {waited:.2f} s for the background write of checkpoint {write.tag} before {before} "
                      "(--async-save)", flush=True)
        if write.error is not None:
            raise CheckpointError(write.error)
        return waited


def _write_and_commit(engine: HostCopyEngine, group, write: Write) -> None:
    """The writer thread: this rank's files, then every rank's outcome and checksums, then rank 0's commit."""
    rank, staging = dist.get_rank(), os.path.join(write.save_dir, protocol.staging_tag(write.tag))
    try:
        failure = None
        try:
            engine.write_queued()
        except OSError as err:  # a full disk, a file-size limit, a vanished folder
            failure = err.strerror or str(err)
        mine = {os.path.relpath(path, staging): crc for path, (_, crc) in engine.written.items() if crc is not None}
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, (failure, mine), group=group)
        failed = [(other, why) for other, (why, _) in enumerate(parts) if why is not None]
        if failed:
            write.error = failed_line(write.save_dir, write.tag, *failed[0], write.previous)
            return
        outcome = [None]
        if rank == 0:
            checksums = {name: crc for _, part in parts for name, crc in part.items()} or None
            try:
                protocol.commit(write.save_dir, write.tag, write.record, checksums=checksums)
            except OSError as err:
                outcome = [err.strerror or str(err)]
            if outcome[0] is None:  # before the other ranks hear of it: their lines about the save come after
                seconds = time.perf_counter() - write.started
                print(f"{saved_line(write.save_dir, write.tag, write.iteration, seconds)}, async: training blocked "
                      f"{write.blocked:.2f} s (host copy {write.host_bytes / 1e6:.1f} MB), "
                      f"background {seconds - write.blocked:.2f} s", flush=True)
        dist.broadcast_object_list(outcome, src=0, group=group)
        if outcome[0] is not None:
            write.error = failed_line(write.save_dir, write.tag, 0, outcome[0], write.previous)
    except Exception as err:  # a rank or host gone while the ranks' writers met: nothing was committed
        kept = (f"'latest' still names {write.previous}, which the next start resumes" if write.previous else
                "no checkpoint is complete there yet")
        write.error = (f"--save {write.save_dir}: the background write of checkpoint {write.tag} was lost "
                       f"({str(err).splitlines()[0] if str(err) else type(err).__name__}); {kept}")
        print(f"warning: {write.error}", flush=True)


def save_in_background(engine, args: Args, iteration: int, consumed_samples: int, rank: int,
                       consumed_tokens: int | None) -> float:
    """--async-save's save: waits for the write before it, copies this save's state to host memory, starts its
    write and returns the seconds training waited."""
    started = time.perf_counter()
    if type(engine.checkpoint_engine) in (TorchCheckpointEngine, FlushingCheckpointEngine):
        engine.checkpoint_engine = HostCopyEngine(engine._config)
    ckpt_engine = engine.checkpoint_engine
    if not isinstance(ckpt_engine, HostCopyEngine):
        raise CheckpointError(f"--async-save: the DeepSpeed JSON's checkpoint engine ({type(ckpt_engine).__name__}) "
                              "writes the files itself; drop --async-save or the JSON's checkpoint engine")
    tag = protocol.tag_name(iteration)
    ckpt_engine.saves.wait(f"saving {tag}")
    previous = write_staged(engine, args, iteration, consumed_samples, rank, consumed_tokens)
    write = Write(args.checkpoint.save, tag, iteration, commit_record(args, iteration, consumed_samples), previous,
                  started)
    write.blocked, write.host_bytes = time.perf_counter() - started, ckpt_engine.host_bytes
    ckpt_engine.saves.start(ckpt_engine, write)
    return write.blocked


def finish(engine, before: str) -> None:
    """Wait for the last background write (the run's end, a stop on a signal or a time limit); a failed one raises
    its line."""
    ckpt_engine = getattr(engine, "checkpoint_engine", None)
    if isinstance(ckpt_engine, HostCopyEngine):
        ckpt_engine.saves.wait(before)
