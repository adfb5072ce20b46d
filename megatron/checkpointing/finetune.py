"""`pretrain_gpt.py --load DIR --finetune`: start from the weights of any zero-lab checkpoint.

DeepSpeed's own load_checkpoint only reads checkpoints written with the same ZeRO partitioning
and parallel layout (a ZeRO-3 engine looks for zero_pp_rank_* files, ZeRO-0/1/2 for
mp_rank_00_model_states.pt), so a run could not start from a ZeRO-3 run's weights, or from
tools/hf_to_checkpoint.py's output, under another stage or layout. Here the checkpoint is
consolidated to one full fp32 state dict; each rank copies in the slice its parameters hold
(its TP shard, its pipeline stage's layers; gathered under ZeRO-3), and the optimizer's fp32
master copies are refreshed.
"""
from __future__ import annotations

import torch

from megatron.checkpointing.resume_check import positions_refusal
from megatron.core.tensor_parallel import ColumnParallelLinear, VocabParallelEmbedding
from megatron.core.tensor_parallel.layers import strided_shard
from megatron.core.tensor_parallel.mappings import group_size
from megatron.model.config import GPTConfig
from megatron.saved_model.layouts import partition_dim
from megatron.saved_model.reader import SavedModelError, load_checkpoint_weights


def _full_shape(param: torch.nn.Parameter) -> tuple[int, ...]:
    return tuple(param.ds_shape) if hasattr(param, "ds_shape") else tuple(param.shape)  # ZeRO-3 keeps a shard


def our_name(name: str, num_layers: int) -> str:
    """GPTModel's name of a parameter of GPTModel or of the pipeline form (a PipelineModule names
    its layers by index: 0 the untied embeddings, 1..L transformer layers, L + 1 the final LayerNorm, L + 2 the
    untied output layer (output_layer.*), tied_modules.embed.*)."""
    if name.startswith("tied_modules.embed."):
        return name[len("tied_modules.embed."):]
    index, _, rest = name.partition(".")
    if not index.isdigit():
        return name
    if int(index) in (0, num_layers + 2):
        return rest
    return f"final_layernorm.{rest}" if int(index) == num_layers + 1 else f"layers.{int(index) - 1}.{rest}"


def _resize_vocabulary(words: torch.Tensor, rows: int) -> torch.Tensor:
    """Rows past the tokenizer's vocabulary are padding (its amount depends on TP size and
    --make-vocab-size-divisible-by): cut them, or add mean rows (see hf_gpt2.state_dict_from_hf)."""
    if rows <= words.shape[0]:
        return words[:rows]
    return torch.cat([words, words.mean(0, keepdim=True).expand(rows - words.shape[0], -1)])


def local_weights(full: dict[str, torch.Tensor], module: torch.nn.Module, num_layers: int, tp_group,
                  where: str) -> dict[str, torch.Tensor]:
    """{parameter name in `module`: the tensor it must hold on this rank}."""
    tp_size = group_size(tp_group)
    local = {}
    for name, param in module.named_parameters():
        source = our_name(name, num_layers)
        if source not in full:
            raise SavedModelError(f"--load {where} --finetune: the checkpoint has no {source} for this model's "
                                  f"{name} (check --num-layers and the other model flags)")
        tensor, dim = full[source], partition_dim(source)
        if source in ("word_embeddings.weight", "output_layer.weight"):
            tensor = _resize_vocabulary(tensor, _full_shape(param)[0] * tp_size)
        # a tensor split in blocks (a gated MLP's gate and up: partition_stride 2): this rank's part of each block
        if dim is not None and tp_size > 1:
            tensor = strided_shard(tensor, dim, tp_group, getattr(param, "partition_stride", 1))
        if tuple(tensor.shape) != _full_shape(param):
            raise SavedModelError(
                f"--load {where} --finetune: {source} is {tuple(full[source].shape)} in the checkpoint, which does "
                f"not fit {_full_shape(param)} in the model the flags describe (check --num-layers, --hidden-size, "
                "--num-attention-heads, --ffn-hidden-size, --max-position-embeddings)")
        local[name] = tensor
    return local


def _tp_group(module: torch.nn.Module):
    """The tensor-parallel group the model's layers were built with (None: serial)."""
    return next((m.group for m in module.modules() if isinstance(m, (VocabParallelEmbedding, ColumnParallelLinear))),
                None)


def settings_check(saved: GPTConfig, current: GPTConfig, load_dir: str) -> list[str]:
    """What the weights' shapes do not show: another --layernorm-epsilon is refused (the norms would scale every
    activation otherwise than in training: 1.3e-2 on a tiny Llama's logits, 1e-6 against 1e-5); another
    --rope-theta is a note, as raising it to fine-tune for longer sequences is a known recipe (Code Llama's)."""
    where = f"--load {load_dir} --finetune"
    if saved.layernorm_epsilon != current.layernorm_epsilon:
        raise SavedModelError(f"{where}: the checkpoint was trained with --layernorm-epsilon "
                              f"{saved.layernorm_epsilon!r}, this run has {current.layernorm_epsilon!r}: pass "
                              f"--layernorm-epsilon {saved.layernorm_epsilon!r}")
    if saved.use_rotary_position_embeddings and saved.rope_theta != current.rope_theta:
        return [f"note: {where}: the checkpoint was trained with --rope-theta {saved.rope_theta!r}, this run "
                f"rotates with {current.rope_theta!r} (pass --rope-theta {saved.rope_theta!r} to keep its angles)"]
    return []


def load_finetune_weights(engine, load_dir: str, trust: bool = False,
                          config: GPTConfig | None = None) -> tuple[str, list[str]]:
    """Copy the checkpoint's weights into the engine's model; returns the checkpoint's tag folder and notes for
    the log. trust: --trust-checkpoint (megatron/safe_load.py); config: the run's model (--model-size and flags)."""
    import deepspeed

    loaded = load_checkpoint_weights(load_dir, trust=trust)
    notes = settings_check(loaded.config, config, load_dir) if config is not None else []
    if loaded.config.is_moe:  # the experts' names are global, a rank's local at EP > 1: not mapped here
        raise SavedModelError(f"--load {load_dir} --finetune: a mixture-of-experts checkpoint "
                              f"({loaded.config.experts_setting}): fine-tuning from it is not "
                              "supported; resume it with --load at its layout (docs/moe.md)")
    module = engine.module
    expected_layers = getattr(getattr(module, "config", None), "num_layers", loaded.config.num_layers)
    if expected_layers != loaded.config.num_layers:
        raise SavedModelError(f"--load {load_dir} --finetune: the checkpoint's weights do not fit this model "
                              f"(it has {loaded.config.num_layers} layers, --num-layers is {expected_layers})")
    positions = "rotary" if loaded.config.use_rotary_position_embeddings else "learned"
    wanted = "learned" if any(name.endswith("position_embeddings.weight") for name, _ in module.named_parameters()) \
        else "rotary"
    refusal = positions_refusal(positions, wanted)
    if refusal:
        raise SavedModelError(f"--load {load_dir} --finetune: {refusal}")
    local = local_weights(loaded.state_dict, module, loaded.config.num_layers, _tp_group(module), load_dir)
    partitioned = [p for p in module.parameters() if hasattr(p, "ds_id")]
    # every rank holds the same full weights, so every rank may write; rank 0's copy is what
    # GatheredParameters re-partitions on exit
    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=0), torch.no_grad():
        for name, param in module.named_parameters():
            param.data.copy_(local[name].to(device=param.device, dtype=param.dtype))
    if hasattr(engine.optimizer, "refresh_fp32_params"):
        engine.optimizer.refresh_fp32_params()
    return loaded.path, notes
