"""The start-up step after flag parsing: every file the run reads or writes is checked before any time
is spent, and the model shape is completed from the tokenizer (docs/bad-input.md, docs/checkpoints.md).

In this order, so that the cheapest mistakes are found first: the output folders (`--save`,
`--tensorboard-dir`, `--run-dir`, `--zero-nvme-path`), the input files (`--data-path`, the tokenizer's
files) and where the dataset index caches go (a read-only data folder sends them to the run's folder),
the tokenizer itself (its padded vocabulary is the model's), then the checkpoint `--load` names
(complete, and loadable by this run's layout; a --load holding none is a fresh start). Each failure is one
line naming the flag and the path.
"""
from __future__ import annotations

import os
import socket
from dataclasses import replace
from pathlib import Path

from megatron.arguments import Args, DataArgs
from megatron.checkpointing.protocol import LATEST, read_latest
from megatron.checkpointing.resume_check import check_resume
from megatron.errors import ZeroLabError
from megatron.tokenizer import build_tokenizer


class StartupError(ZeroLabError, ValueError):
    """A file or folder the run needs is missing, unreadable or unwritable; the message names the flag."""


def _require(condition, message):
    if not condition:
        raise StartupError(message)


def require_writable_folder(flag: str, path: str | None) -> None:
    """`path` is a writable folder or can be made: its nearest existing ancestor is a writable folder."""
    if path is None:
        return
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    _require(os.path.isdir(existing), f"{flag} {path}: {existing} is not a folder")
    _require(os.access(existing, os.W_OK | os.X_OK), f"{flag} {path}: {existing} is not writable")


def require_readable(flag: str, path: str) -> None:
    """An existing file can still be unreadable (permissions, a broken network mount)."""
    try:
        open(path, "rb").close()
    except OSError as err:
        raise StartupError(f"{flag}: {path} cannot be read ({err.strerror})") from None


def check_nvme_path(path: str) -> None:
    """Refuse NVMe offload up front where it cannot run: a folder that cannot be made, or DeepSpeed's async
    I/O op that cannot be built (it needs libaio: `apt-get install -y libaio-dev`)."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise StartupError(f"--zero-nvme-path {path}: cannot create the folder ({err.strerror})") from err
    from deepspeed.accelerator import get_accelerator
    builder = get_accelerator().create_op_builder("AsyncIOBuilder")
    if builder is None or not builder.is_compatible(verbose=False):
        raise StartupError(f"--zero-nvme-path {path}: DeepSpeed's async I/O op cannot be built on this machine "
                           "(it needs libaio: apt-get install -y libaio-dev)")


def check_output_folders(args: Args) -> None:
    for flag, path in (("--save", args.checkpoint.save), ("--tensorboard-dir", args.logging.tensorboard_dir),
                       ("--run-dir", args.deepspeed.run_dir)):
        require_writable_folder(flag, path)
    if args.deepspeed.nvme_path is not None:
        check_nvme_path(args.deepspeed.nvme_path)


def check_input_files(data: DataArgs) -> None:
    prefixes = data.data_path if len(data.data_path) == 1 else data.data_path[1::2]
    for prefix in prefixes:
        for suffix in (".bin", ".idx"):
            _require(os.path.isfile(prefix + suffix),
                     f"--data-path: {prefix + suffix} does not exist "
                     "(expected a prefix with .bin/.idx files from tools/preprocess_data.py)")
            require_readable("--data-path", prefix + suffix)
    if data.tokenizer_type == "GPT2BPETokenizer":
        for flag, path in (("--vocab-file", data.vocab_file), ("--merge-file", data.merge_file)):
            _require(path is not None and os.path.isfile(path), f"{flag} {path} does not exist (GPT2BPETokenizer needs it)")
            require_readable(flag, path)


def index_cache_folder(args: Args) -> tuple[str | None, str | None]:
    """(where the dataset index caches go: None next to the data; a notice when that is not the default).
    A data folder that cannot be written (a cluster's shared read-only datasets) sends them to the run's
    folder, which every host of the run sees."""
    data = args.data
    if data.data_cache_path is not None:
        require_writable_folder("--data-cache-path", data.data_cache_path)
        return data.data_cache_path, None
    prefixes = data.data_path if len(data.data_path) == 1 else data.data_path[1::2]
    read_only = sorted({folder for folder in (os.path.dirname(os.path.abspath(p)) for p in prefixes)
                        if not os.access(folder, os.W_OK)})
    if not read_only:
        return None, None
    base = args.deepspeed.run_dir or args.checkpoint.save
    if base is None:
        raise StartupError(f"--data-path: {read_only[0]} is not writable, so the dataset index caches cannot go next "
                           "to the data: give --data-cache-path (or --run-dir)")
    folder = os.path.join(base, "index-cache")
    return folder, f"note: {read_only[0]} is not writable: the dataset index caches go to {folder} (--data-cache-path)"


def check_checkpoint_to_load(args: Args) -> None:
    """--finetune needs weights; a resume, when --load holds a checkpoint, needs it complete and loadable (a
    --load without one starts afresh, as in Megatron: the launch scripts always pass their run's folder)."""
    load = args.checkpoint.load
    if load is None:
        return
    if args.checkpoint.finetune:  # weights only, from any layout (megatron/checkpointing/finetune.py)
        _require(os.path.isfile(os.path.join(load, LATEST)), f"--load {load} holds no checkpoint (no 'latest' file there)")
    elif read_latest(load) is not None:
        check_resume(args)


def prepare_run(args: Args, verbose: bool):
    """(args with the model's padded vocabulary and the index cache folder filled in, the tokenizer); a
    ZeroLabError (one line) when a file the run needs is not right. verbose: rank 0, which says what it did."""
    check_output_folders(args)
    check_input_files(args.data)
    cache, notice = index_cache_folder(args)
    if cache is not None:
        Path(cache).mkdir(parents=True, exist_ok=True)
    if notice and verbose:
        print(notice, flush=True)
    tokenizer = build_tokenizer(args.data, verbose=verbose)
    args = replace(args, model=replace(args.model, padded_vocab_size=tokenizer.padded_vocab_size),
                   data=replace(args.data, data_cache_path=cache))
    check_checkpoint_to_load(args)
    return args, tokenizer


def check_save_folder_is_shared(save: str | None) -> None:
    """After the ranks met, before anything is trained (a collective: every rank calls it): with ranks on
    several hosts, --save must be one folder every host sees (a checkpoint's files come from every rank, and
    rank 0 lists them). Each host writes a probe there; rank 0 must see every host's. One line names a host
    whose probe rank 0 cannot see, on every rank."""
    import torch.distributed as dist

    if save is None or dist.get_world_size() == 1:
        return
    host, probe = socket.gethostname(), None
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        os.makedirs(save, exist_ok=True)
        probe = os.path.join(save, f".zero-lab-probe-{host}-{os.getpid()}")
        Path(probe).write_text(host)
    written = [None] * dist.get_world_size()
    dist.all_gather_object(written, (host, probe))
    unseen = [None]
    if dist.get_rank() == 0:
        unseen = [next(((other, path) for other, path in written if path and not os.path.exists(path)), None)]
    dist.broadcast_object_list(unseen, src=0)
    if probe is not None:
        os.remove(probe)
    if unseen[0] is not None:
        other, path = unseen[0]
        rank0_host = written[0][0]
        raise StartupError(f"--save {save}: host {other} wrote {path} there, but rank 0 on {rank0_host} does not see "
                           f"it: --save must be one folder every host shares (a cluster filesystem), not a "
                           f"folder local to each host")
