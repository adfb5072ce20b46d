"""Resume on another layout (`--universal-checkpoint`): DeepSpeed's universal checkpoint.

ZeRO's optimizer files are partitioned for the data-parallel size and stage that wrote them, and
DeepSpeed's engine loads them only into that layout. DeepSpeed's ds_to_universal rewrites a
checkpoint into one folder per parameter (fp32 weights, Adam moments, step), which an engine of any
data-parallel size and ZeRO stage 1-3 loads when its config has "checkpoint": {"load_universal": true}
(megatron/deepspeed_config.py adds it for this flag). Rank 0 converts `<tag>` into `<tag>_universal`
once, under a temporary name renamed when whole; later resumes reuse it.

DeepSpeed 0.19.8 cannot do, and a run refuses at start-up with one line (resume_check.universal_refusal):
- a checkpoint saved at ZeRO stage 0 (ds_to_universal reads the ZeRO optimizer files it lacks);
- a run at ZeRO stage 0 (the engine restores universal weights only through a ZeRO optimizer);
- a ZeRO-3 checkpoint in a ZeRO-1/2 run (ds_to_universal writes a ZeRO-3 checkpoint's parameters as bare
  tensors, the ZeRO-1/2 loader reads dicts, and its optimizer_state.pt lacks what that loader asserts);
- another tensor- or pipeline-parallel size (megatron/checkpointing/resume_check.py says why);
- a mixture-of-experts checkpoint (ds_to_universal converts AutoEP's experts only, not deepspeed.moe's).

Gaps of DeepSpeed 0.19.8 bridged here, each for a ZeRO-3 run resuming a ZeRO-1/2 checkpoint:
- a ZeRO-3 engine reads zero_pp_rank_0_mp_rank_00_model_states.pt, ds_to_universal writes
  mp_rank_00_model_states.pt: both names are made;
- a ZeRO-3 engine reads Adam's step from zero/optimizer_state.pt's `optimizer_state_dict`, which only a
  ZeRO-3 source has: it is filled in from the per-parameter step.pt;
- the ZeRO-3 universal loader copies param group 0's hyperparameters onto every group (so the group
  without weight decay would get it): every group's hyperparameters but the scheduled lr are put back
  after the load;
- that loader gives every sub-group's Adam state one shared `step` tensor, which the fused AdamW then
  advances once per sub-group at each step (wrong bias corrections from the first step on): each gets a copy.
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import os
import shutil
import sys
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron.checkpointing.protocol import UNIVERSAL_SUFFIX, CheckpointError, incomplete_reason, write_marker
from megatron.errors import ZeroLabError
from megatron.safe_load import restricted_unpickling

if TYPE_CHECKING:
    from megatron.arguments import Args

_ZERO3_MODEL_STATES = "zero_pp_rank_0_mp_rank_00_model_states.pt"


def _fill_zero3_optimizer_state(folder: str) -> None:
    """Give zero/optimizer_state.pt the `optimizer_state_dict` a ZeRO-3 engine reads (see the docstring)."""
    path = os.path.join(folder, "zero", "optimizer_state.pt")
    # weights_only=False is overridden to True by restricted_unpickling unless --trust-checkpoint
    state = torch.load(path, map_location="cpu", weights_only=False)
    if "optimizer_state_dict" in state:  # converted from a ZeRO-3 checkpoint
        return
    step_file = next(iter(sorted(glob.glob(os.path.join(folder, "zero", "*", "step.pt")))), None)
    if step_file is None:
        raise CheckpointError(f"{folder}: ds_to_universal wrote no zero/*/step.pt (no optimizer step to resume)")
    step = torch.load(step_file, map_location="cpu", weights_only=False)
    state["optimizer_state_dict"] = {"state": {0: {"step": step}}, "param_groups": state["param_groups"]}
    torch.save(state, path)


def convert(load_dir: str, tag: str, trust: bool) -> str:
    """Write `<tag>_universal` from `<tag>` with ds_to_universal (rank 0 only); returns the new tag."""
    from deepspeed.checkpoint import ds_to_universal

    target = os.path.join(load_dir, tag + UNIVERSAL_SUFFIX)
    tmp = f"{target}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    options = argparse.Namespace(input_folder=os.path.join(load_dir, tag), output_folder=tmp, num_extract_workers=1,
                                 num_merge_workers=1, keep_temp_folder=False, strict=True,
                                 # zero-lab's model declares no TP patterns (TP is refused): the version is enough
                                 inject_missing_state=True)
    try:
        # ds_to_universal narrates each step on stdout; keep stdout for the training log's own lines
        with restricted_unpickling(trust, options.input_folder), contextlib.redirect_stdout(sys.stderr):
            ds_to_universal.main(options)
            model_states = os.path.join(tmp, "mp_rank_00_model_states.pt")
            if not os.path.exists(os.path.join(tmp, _ZERO3_MODEL_STATES)):
                os.link(model_states, os.path.join(tmp, _ZERO3_MODEL_STATES))
            elif not os.path.exists(model_states):
                os.link(os.path.join(tmp, _ZERO3_MODEL_STATES), model_states)
            _fill_zero3_optimizer_state(tmp)
    except ZeroLabError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except (OSError, AssertionError, ValueError, KeyError) as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"--load {load_dir} --universal-checkpoint: converting {tag} failed "
                              f"({type(err).__name__}: {err})") from None
    write_marker(tmp, {"converted_from": tag})
    shutil.rmtree(target, ignore_errors=True)  # an unfinished earlier conversion (no marker)
    os.rename(tmp, target)
    # ds_to_universal pointed latest_universal at the temporary name
    with open(os.path.join(load_dir, "latest_universal"), "w") as handle:
        handle.write(tag + UNIVERSAL_SUFFIX)
    return tag + UNIVERSAL_SUFFIX


def _restore_hyperparameters(engine, saved_groups: list[dict]) -> None:
    base = getattr(engine.optimizer, "optimizer", engine.optimizer)
    for group, saved in zip(base.param_groups, saved_groups):
        group.update(saved)
    # one `step` tensor per sub-group's state (the loader shares one; see the module docstring)
    for state in base.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


def load_universal(engine, args: Args, tag: str):
    """engine.load_checkpoint of `<tag>_universal` (converted first when needed); DeepSpeed's
    (load path, client state)."""
    load_dir, trust = args.checkpoint.load, args.checkpoint.trust_checkpoint
    if not engine.load_universal_checkpoint():
        raise CheckpointError("--universal-checkpoint: the DeepSpeed config lacks \"checkpoint\": "
                              "{\"load_universal\": true} (a --deepspeed_config file must set it)")
    universal = tag + UNIVERSAL_SUFFIX
    if dist.get_rank() == 0 and incomplete_reason(os.path.join(load_dir, universal)) is not None:
        convert(load_dir, tag, trust)
    dist.barrier()  # the other ranks read what rank 0 converted
    base = getattr(engine.optimizer, "optimizer", engine.optimizer)
    hyperparameters = [{key: value for key, value in group.items() if key not in ("params", "lr")}
                       for group in base.param_groups]
    with restricted_unpickling(trust, os.path.join(load_dir, universal)):
        path, client_state = engine.load_checkpoint(load_dir, tag=universal)
    _restore_hyperparameters(engine, hyperparameters)
    return path, client_state
