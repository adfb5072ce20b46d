"""Checkpoints through DeepSpeed's engine, plus our client state (iteration, samples, RNG, args).

DeepSpeed writes the `latest` pointer only after every rank finished its files (verified in
tests/test_resume.py); our own extra file is written under a temporary name and renamed.
"""
import json
import os
import random
from dataclasses import asdict

import numpy as np
import torch

from megatron.arguments import Args


def rng_state(module: torch.nn.Module) -> dict:
    """Every generator dropout can draw from, including the model's tensor-parallel tracker."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    tracker = getattr(module, "rng_tracker", None)
    if tracker is not None:
        state["model_parallel_tracker"] = tracker.get_states()
    return state


def set_rng_state(state: dict, module: torch.nn.Module) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    tracker = getattr(module, "rng_tracker", None)
    if tracker is not None and "model_parallel_tracker" in state:
        tracker.set_states(state["model_parallel_tracker"])


def _tag(iteration: int) -> str:
    return f"global_step{iteration}"


def save_checkpoint(engine, args: Args, iteration: int, consumed_samples: int, rank: int) -> None:
    client_state = {"iteration": iteration, "consumed_samples": consumed_samples,
                    "rng_state": rng_state(engine.module), "args": asdict(args)}
    engine.save_checkpoint(args.checkpoint.save, tag=_tag(iteration), client_state=client_state)
    if rank == 0:
        _write_json_atomic(os.path.join(args.checkpoint.save, _tag(iteration), "zero_lab_state.json"),
                           {"iteration": iteration, "consumed_samples": consumed_samples,
                            "argv": args.argv})
    print(f"  successfully saved checkpoint at iteration {iteration:8d} to {args.checkpoint.save}", flush=True)


def _write_json_atomic(path: str, payload: dict) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as handle:
        json.dump(payload, handle, indent=2)
    os.replace(tmp, path)


def load_checkpoint(engine, args: Args) -> tuple[int, int, dict | None]:
    """Returns (iteration, consumed_samples, RNG states); with --finetune only the weights are taken.
    The caller restores the RNG states with set_rng_state as the last thing before training: creating
    a DataLoader iterator draws from torch's RNG, so restoring earlier would not continue the run exactly."""
    if args.checkpoint.finetune:
        # weights only, from a checkpoint of any ZeRO stage or tools/hf_to_checkpoint.py (DeepSpeed's
        # loader needs the same partitioning as the run); iteration, optimizer and schedule start afresh
        from megatron.inference.finetune import load_finetune_weights
        path = load_finetune_weights(engine, args.checkpoint.load)
        print(f"  loaded weights from {path} for fine-tuning (iteration and optimizer reset)", flush=True)
        return 0, 0, None
    path, client_state = engine.load_checkpoint(args.checkpoint.load)
    if path is None:
        raise RuntimeError(f"--load {args.checkpoint.load}: DeepSpeed found no loadable checkpoint")
    print(f"  loaded checkpoint {path} at iteration {client_state['iteration']}", flush=True)
    return client_state["iteration"], client_state["consumed_samples"], client_state["rng_state"]
