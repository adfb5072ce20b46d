"""Reassemble one full state dict (TP=1, not pipelined, our GPTModel names) from the pieces a
tensor- and/or pipeline-parallel run saves.

Tensor parallelism splits column-parallel weights (word embedding rows, QKV and h->4h outputs)
along dim 0 and row-parallel weights (attention output, 4h->h) along dim 1; everything else is
replicated. The fused QKV is laid out per head, so concatenating the ranks' rows gives the
full per-head layout. DeepSpeed's pipeline engine saves one file per layer and TP rank,
`layer_XX-model_YY-model_states.pt`: layer 0 the embeddings, 1..L the transformer layers,
L + 1 the final LayerNorm (the tied output layer reuses layer 0's weight and is not saved; an untied one,
--untie-embeddings-and-output-weights, is layer L + 2, its keys output_layer.*). A tensor the layer's recipe
splits in blocks (megatron/model/recipe.py's strides: a gated MLP's h->4h shards are each [gate_r; up_r],
Megatron's layout) is merged block by block: the gates come first, then the ups.
"""
from __future__ import annotations

import glob
import os
import re

import torch

from megatron.model.recipe import mlp_part

COLUMN_PARALLEL = ("word_embeddings.weight", "query_key_value.weight", "query_key_value.bias",
                   "dense_h_to_4h.weight", "dense_h_to_4h.bias", "output_layer.weight")
ROW_PARALLEL = ("self_attention.dense.weight", "dense_4h_to_h.weight")
_LAYER_FILE = re.compile(r"layer_(\d+)-model_(\d+)-model_states\.pt$")


def partition_dim(name: str) -> int | None:
    if name.endswith(COLUMN_PARALLEL):
        return 0
    if name.endswith(ROW_PARALLEL):
        return 1
    return None


def merge_tensor_parallel(shards: list[dict[str, torch.Tensor]], strides: dict[str, int] | None = None,
                          **mlp_flags: bool) -> dict[str, torch.Tensor]:
    """One state dict from the TP ranks' state dicts, in rank order. strides: {name suffix: blocks} of the tensors
    split block by block (the recipe's MLP's strides); by default those of the MLP its GPTConfig flags pick
    (e.g. the keyword of the gated MLP's flag; none: GELU's, which has no blocks)."""
    if len(shards) == 1:
        return shards[0]
    strides = mlp_part(**mlp_flags).strides if strides is None else strides
    merged = {}
    for name, first in shards[0].items():
        dim = partition_dim(name)
        stride = next((k for suffix, k in strides.items() if name.endswith(suffix)), 1)
        if dim is None:
            merged[name] = first
        else:
            blocks = [shard[name].chunk(stride, dim=dim) for shard in shards]
            merged[name] = torch.cat([rank[block] for block in range(stride) for rank in blocks], dim=dim)
    return merged


def pipeline_layer_files(folder: str) -> dict[tuple[int, int], str]:
    """{(layer index, TP rank): path} of a pipeline checkpoint (empty if there is none)."""
    files = {}
    for path in glob.glob(os.path.join(folder, "layer_*-model_*-model_states.pt")):
        match = _LAYER_FILE.search(os.path.basename(path))
        if match:
            files[(int(match.group(1)), int(match.group(2)))] = path
    return files


def gather_pipeline_layers(files: dict[tuple[int, int], str], tp_rank: int) -> dict[str, torch.Tensor]:
    """One TP rank's whole model, in GPTModel names, from the per-layer files."""
    indices = sorted(index for index, rank in files if rank == tp_rank)
    if not indices or indices != list(range(len(indices))) or len(indices) < 3:
        raise ValueError(f"pipeline layer files of TP rank {tp_rank} are incomplete: layers {indices}")
    # weights_only=False takes effect only with --trust-checkpoint (reader.load_checkpoint_weights)
    modules = {index: torch.load(files[(index, tp_rank)], map_location="cpu", weights_only=False, mmap=True)
               for index in indices}
    untied = any(name.startswith("output_layer.") for name in modules[indices[-1]])
    last = indices[-2] if untied else indices[-1]  # the final norm; 1..last-1 are the transformer layers
    state = {}
    for index, module in modules.items():
        prefix = "" if index == 0 or index > last else "final_layernorm." if index == last else f"layers.{index - 1}."
        state.update({prefix + name: tensor.float() for name, tensor in module.items()})
    return state
