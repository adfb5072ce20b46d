"""`pretrain_gpt.py --load DIR --finetune`: start from the weights of any zero-lab checkpoint.

DeepSpeed's own load_checkpoint only reads checkpoints written with the same ZeRO partitioning
(a ZeRO-3 engine looks for zero_pp_rank_* files, ZeRO-0/1/2 for mp_rank_00_model_states.pt), so a
run could not start from a ZeRO-3 run's weights, or from tools/hf_to_checkpoint.py's output, under
another stage. Here the checkpoint is consolidated to one fp32 state dict and copied into the
engine's parameters (gathered under ZeRO-3); the optimizer's fp32 master copies are refreshed.
"""
from __future__ import annotations

import torch

from megatron.inference.checkpoint import CheckpointError, load_checkpoint_weights


def _full_shape(param: torch.nn.Parameter) -> tuple[int, ...]:
    return tuple(param.ds_shape) if hasattr(param, "ds_shape") else tuple(param.shape)  # ZeRO-3 keeps a shard


def check_matches_engine(state_dict: dict[str, torch.Tensor], module: torch.nn.Module, where: str) -> None:
    params = dict(module.named_parameters())
    missing, unexpected = sorted(set(params) - set(state_dict)), sorted(set(state_dict) - set(params))
    if missing or unexpected:
        raise CheckpointError(f"--load {where} --finetune: the checkpoint's weights do not fit this model "
                              f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    for name, param in params.items():
        if tuple(state_dict[name].shape) != _full_shape(param):
            raise CheckpointError(
                f"--load {where} --finetune: {name} is {tuple(state_dict[name].shape)} in the checkpoint but "
                f"{_full_shape(param)} in the model the flags describe (check --num-layers, --hidden-size, "
                "--num-attention-heads, --max-position-embeddings, the vocabulary)")


def load_finetune_weights(engine, load_dir: str) -> str:
    """Copy the checkpoint's weights into the engine's model; returns the checkpoint's tag folder."""
    import deepspeed

    loaded = load_checkpoint_weights(load_dir)
    module = engine.module
    check_matches_engine(loaded.state_dict, module, load_dir)
    partitioned = [p for p in module.parameters() if hasattr(p, "ds_id")]
    # every rank holds the same full weights, so every rank may write; rank 0's copy is what
    # GatheredParameters re-partitions on exit
    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=0), torch.no_grad():
        for name, param in module.named_parameters():
            param.data.copy_(loaded.state_dict[name].to(device=param.device, dtype=param.dtype))
    if hasattr(engine.optimizer, "refresh_fp32_params"):
        engine.optimizer.refresh_fp32_params()
    return loaded.path
