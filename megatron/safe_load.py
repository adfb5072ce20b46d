"""No code runs from a checkpoint: every torch.load made while loading one is restricted to tensors
and plain types (torch's `weights_only` unpickler), plus the few DeepSpeed types it pickles.

A pickle can name any importable callable and have it called on load, so a crafted checkpoint (a
downloaded one, a file in a shared cluster folder) could run code. DeepSpeed calls torch.load with
weights_only=False in many places (its checkpoint engine, the ZeRO optimizers' universal loaders,
zero_to_fp32, ds_to_universal); torch's TORCH_FORCE_WEIGHTS_ONLY_LOAD switch overrides every such
call, so `restricted_unpickling` sets it for the duration of a load instead of patching DeepSpeed.
`--trust-checkpoint` turns the restriction off (docs/checkpoints.md).
"""
import contextlib
import glob
import os
import pickle

import torch

from megatron.errors import ZeroLabError

_FORCE = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"


class UnsafeCheckpointError(ZeroLabError, ValueError):
    """A checkpoint file holds a pickled object outside the allow-list; the message names it."""


def allowed_globals() -> list:
    """What DeepSpeed itself pickles into its files (the ZeRO optimizer states), and the numpy array
    pieces of the RNG state in checkpoints saved before zero-lab stored it as plain types (a numpy
    array is data: its elements go through the same restricted unpickler). Imported here, not at
    module level, so that tools reading a stage-0 checkpoint need not import DeepSpeed."""
    import numpy as np
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address,
            np._core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def _allowed_names() -> set[str]:
    return {f"{cls.__module__}.{cls.__qualname__}" for cls in allowed_globals()}


def unsafe_globals(path: str) -> list[str]:
    """The importable names a torch checkpoint file's pickle refers to that are not allowed
    (reads the pickle only, never runs it)."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except (RuntimeError, OSError, ValueError, pickle.UnpicklingError):
        return []  # not a zip checkpoint: the load itself reports what is wrong with it
    return sorted(name for name in names if name not in _allowed_names())


def refusal(path: str, names: list[str]) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{path}: refusing to load, it holds a pickled {', '.join(names)} (a checkpoint may hold only tensors "
        "and plain types; unpickling other objects can run code). Give --trust-checkpoint only if you "
        "trust where this file came from")


def _first_unsafe_file(paths: list[str]) -> tuple[str, list[str]] | None:
    for path in paths:
        names = unsafe_globals(path)
        if names:
            return path, names
    return None


@contextlib.contextmanager
def restricted_unpickling(trust: bool, where: str):
    """Every torch.load inside the block is weights_only with allowed_globals() allowed. A refused
    file becomes one UnsafeCheckpointError naming the file (searched for under `where`, a file or a
    folder) and the type. trust=True: no restriction (--trust-checkpoint)."""
    if trust:
        yield
        return
    previous = os.environ.get(_FORCE)
    os.environ[_FORCE] = "1"
    try:
        with torch.serialization.safe_globals(allowed_globals()):
            yield
    except pickle.UnpicklingError as err:
        files = [where] if os.path.isfile(where) else sorted(glob.glob(os.path.join(where, "**", "*.pt"),
                                                                       recursive=True))
        found = _first_unsafe_file(files)
        if found is None:
            raise UnsafeCheckpointError(f"{where}: refusing to load a checkpoint file "
                                        f"({str(err).splitlines()[0]})") from None
        raise refusal(*found) from None
    finally:
        if previous is None:
            os.environ.pop(_FORCE, None)
        else:
            os.environ[_FORCE] = previous


def load_file(path: str, trust: bool = False, **kwargs):
    """torch.load of one checkpoint file under restricted_unpickling (map_location defaults to the CPU)."""
    kwargs.setdefault("map_location", "cpu")
    with restricted_unpickling(trust, path):
        return torch.load(path, **kwargs)
