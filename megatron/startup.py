"""The start-up step after flag parsing: every file the run reads or writes is checked before any time
is spent, and the model shape is completed from the tokenizer (docs/bad-input.md, docs/checkpoints.md).

In this order, so that the cheapest mistakes are found first: the output folders (`--save`,
`--tensorboard-dir`, `--run-dir`, `--zero-nvme-path`), the input files (`--data-path`, the tokenizer's
files), the tokenizer itself (its padded vocabulary is the model's), then the checkpoint `--load` names
(complete, and loadable by this run's layout). Each failure is one line naming the flag and the path.
"""
from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from megatron.arguments import Args, DataArgs
from megatron.checkpointing.protocol import LATEST
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
        with open(path, "rb"):
            pass
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


def check_checkpoint_to_load(args: Args) -> None:
    load = args.checkpoint.load
    if load is None:
        return
    if args.checkpoint.finetune:  # weights only, from any layout (megatron/finetune.py)
        _require(os.path.isfile(os.path.join(load, LATEST)), f"--load {load} holds no checkpoint (no 'latest' file there)")
    else:
        check_resume(args)


def prepare_run(args: Args, verbose: bool):
    """(args with the model's padded vocabulary filled in, the tokenizer); a ZeroLabError (one line) when a
    file the run needs is not right. verbose: the tokenizer says what it built (rank 0)."""
    check_output_folders(args)
    check_input_files(args.data)
    tokenizer = build_tokenizer(args.data, verbose=verbose)
    args = replace(args, model=replace(args.model, padded_vocab_size=tokenizer.padded_vocab_size))
    check_checkpoint_to_load(args)
    return args, tokenizer
