"""The random generators a resumed run continues from, so that it repeats an uninterrupted run's losses.

Each rank saves its own generators in a file of its own (`rng_state_rank<R>.pt` in the checkpoint's
folder, in the manifest like every file of it): at ZeRO stages 0-2 DeepSpeed writes the client state
from data-parallel rank 0 only, and a rank restoring rank 0's states would take rank 0's view of every
GPU's generator, resetting the streams of the GPUs rank 0 never drew from."""
import os
import random

import numpy as np
import torch

from megatron.safe_load import load_file


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


def rank_file(folder: str, rank: int) -> str:
    return os.path.join(folder, f"rng_state_rank{rank}.pt")


def save_own_rng_state(checkpoint_engine, folder: str, rank: int, state: dict) -> None:
    """This rank's generators into the checkpoint being written, through the engine that writes (and
    checksums) the rest of it."""
    os.makedirs(folder, exist_ok=True)  # a rank that writes no DeepSpeed file may get here first
    checkpoint_engine.save(state, rank_file(folder, rank))


def own_rng_state(folder: str, rank: int, client_state: dict, trust: bool = False) -> dict:
    """The generators this rank saved in the checkpoint in `folder`. A checkpoint saved before each
    rank had its file, or a rank the checkpoint had not (a resume on more ranks), gets the client
    state's, the one rank's that wrote it, as before."""
    path = rank_file(folder, rank)
    if not os.path.isfile(path):
        return client_state["rng_state"]
    return load_file(path, trust=trust)
