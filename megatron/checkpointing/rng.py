"""The random generators a resumed run continues from, so that it repeats an uninterrupted run's losses."""
import random

import numpy as np
import torch


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
