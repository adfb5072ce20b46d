"""Shared pieces of the GPT data pipeline: the error type, Megatron's --data-path and
--split parsing, the C++ helper import, and "local rank 0 builds, the others wait"."""
import math
import os
from typing import Callable

import torch
import torch.distributed as dist

from megatron.errors import ZeroLabError


class DatasetError(ZeroLabError, ValueError):
    """Bad data input; the message names the prefix, file or flag and what was expected."""


def load_helpers():
    """The compiled `megatron.data.helpers` extension, or a DatasetError saying how to build it."""
    try:
        from megatron.data import helpers
    except ImportError as exc:
        raise DatasetError(
            f"the C++ extension megatron.data.helpers is not built ({exc}); "
            "run `pip install -e .` in the zero-lab checkout") from None
    return helpers


def parse_data_path(data_prefix: list[str]) -> list[tuple[float, str]]:
    """Megatron's --data-path: `PREFIX` or `W1 PREFIX1 W2 PREFIX2 ...`.
    Returns (weight, prefix) pairs with the weights normalized to sum to 1."""
    if isinstance(data_prefix, str):
        data_prefix = [data_prefix]
    if not data_prefix:
        raise DatasetError("--data-path is empty; expected PREFIX or WEIGHT PREFIX [WEIGHT PREFIX ...]")
    if len(data_prefix) == 1:
        return [(1.0, str(data_prefix[0]))]
    if len(data_prefix) % 2 != 0:
        raise DatasetError(
            f"--data-path has {len(data_prefix)} entries; with several datasets expected "
            f"pairs WEIGHT PREFIX, got: {' '.join(map(str, data_prefix))}")
    pairs = []
    for weight_text, prefix in zip(data_prefix[0::2], data_prefix[1::2]):
        try:
            weight = float(weight_text)
        except ValueError:
            raise DatasetError(f"--data-path weight {weight_text!r} (before {prefix}) is not a number") from None
        if not math.isfinite(weight) or weight <= 0:
            raise DatasetError(f"--data-path weight {weight_text!r} for {prefix} must be a positive number")
        pairs.append((weight, str(prefix)))
    total = sum(weight for weight, _ in pairs)
    return [(weight / total, prefix) for weight, prefix in pairs]


def parse_splits(splits_string: str) -> list[float]:
    """Megatron's --split, e.g. "949,50,1" or "98/2/0": up to three non-negative numbers
    (missing ones are 0), returned normalized as train/valid/test fractions."""
    text = str(splits_string).strip()
    parts = [part.strip() for part in text.replace("/", ",").split(",")]
    if len(parts) > 3:
        raise DatasetError(f"--split {text!r}: expected at most 3 comma-separated numbers (train,valid,test)")
    try:
        values = [float(part) for part in parts]
    except ValueError:
        raise DatasetError(f"--split {text!r}: expected numbers such as 949,50,1") from None
    if any(not math.isfinite(value) or value < 0 for value in values):
        raise DatasetError(f"--split {text!r}: entries must be non-negative numbers")
    values += [0.0] * (3 - len(values))
    total = sum(values)
    if total <= 0:
        raise DatasetError(f"--split {text!r}: the entries sum to 0; at least one split needs data")
    return [value / total for value in values]


def split_boundaries(fractions: list[float], num_documents: int) -> list[int]:
    """Document index boundaries [0, train_end, valid_end, num_documents] for the fractions.
    Each boundary is rounded, and rounding drift is taken off the end (Megatron's rule)."""
    bounds = [0]
    for fraction in fractions:
        bounds.append(bounds[-1] + int(round(fraction * num_documents)))
    drift = bounds[-1] - num_documents
    return [bounds[0]] + [bound - drift for bound in bounds[1:]]


def blended_num_samples(weights: list[float], num_samples: tuple[int, int, int]) -> list[tuple[int, int, int]]:
    """Samples to build per blended dataset: a 0.5% margin over its share (Megatron's rule)
    so that the greedy blending order never runs past the end of a dataset."""
    return [tuple(int(math.ceil(n * weight * 1.005)) for n in num_samples) for weight in weights]


def local_rank() -> int:
    """This process's rank on its node; the launcher sets LOCAL_RANK (torchrun, deepspeed,
    or megatron.runtime.dist_env for MPI launchers)."""
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    return dist.get_rank() if dist.is_initialized() else 0


def build_on_local_rank_zero(build: Callable[[], None], what: str) -> None:
    """Run build() on local rank 0 of every node while the other ranks wait; without
    torch.distributed, just run it. Each node builds its own copy so that nodes without
    a shared filesystem work (builders write atomically, so a shared one is fine too).

    Collective: every rank of the default group must call this. A failure on a builder is
    raised there and reported on the waiting ranks instead of leaving them at a barrier."""
    if not dist.is_initialized():
        build()
        return
    failure = None
    if local_rank() == 0:
        try:
            build()
        except Exception as exc:  # re-raised below, after the other ranks are released
            failure = exc
    # An all-reduce serves as the barrier and carries "did any builder fail".
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    failed = torch.tensor([1 if failure is not None else 0], dtype=torch.int64, device=device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failure is not None:
        raise failure
    if failed.item():
        raise DatasetError(f"building {what} failed on a local rank 0; see that rank's error")
