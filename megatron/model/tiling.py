"""ALST's tiling along the sequence (Arctic Long Sequence Training; docs/long-sequences.md): how many tiles
--tiled-mlp-compute and --tiled-logits-loss cut a rank's tokens into, and the tiled MLP itself.

The tiled MLP is DeepSpeed's TiledMLP (deepspeed/runtime/sequence_parallel/ulysses_sp.py): its forward runs each
tile under no_grad and keeps only the input; its backward recomputes each tile and back-propagates it, telling
ZeRO (ds_grad_is_ready) to reduce the parameters' gradients only after the last tile. Two things of it are worked
around here rather than copied: its backward cuts the tokens flattened to [b x s, h] while its forward cuts the
sequence dimension of [b, s, h], and Megatron's --sequence-parallel gathers the sequence dimension of a 3-D input;
and torch.chunk may give fewer tiles than asked (6 rows in 4 tiles: 3 of 2), after which its last-tile test never
fires and ZeRO would never reduce. So the MLP sees its tokens as one [1, b x s, h] sequence, which both passes cut
alike, in the number of tiles torch.chunk really makes.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from megatron.model.config import GPTConfig

# ALST's automatic loss tiles (ArcticTraining's sft trainer): about 1 GiB of fp32 logits each
LOSS_TILE_BYTES = 2**30


def chunk_count(rows: int, tiles: int) -> int:
    """The tiles torch.chunk really cuts `rows` into when asked for `tiles`: ceil(rows / ceil(rows / tiles))."""
    tiles = max(1, min(tiles, rows))
    return math.ceil(rows / math.ceil(rows / tiles))


def mlp_tiles(config: GPTConfig, batch: int, seq: int) -> int:
    """Tiles of --tiled-mlp-compute over a rank's [batch, seq] tokens (1: untiled): --tiled-mlp-shards, or ALST's
    ceil(seq / hidden) (DeepSpeed's TiledMLP example: the tiles' [tokens, ffn] intermediates then hold about as much
    as the [seq, hidden] input kept)."""
    if not config.tiled_mlp_compute:
        return 1
    tiles = config.tiled_mlp_shards or math.ceil(seq / config.hidden_size)
    return chunk_count(batch * seq, tiles)


def loss_tiles(config: GPTConfig, rows: int, vocab_slice: int) -> int:
    """Tiles of --tiled-logits-loss over `rows` tokens of a [rows, vocab_slice] fp32 buffer (1: untiled):
    --tiled-logits-loss-shards, or ALST's ceil(fp32 logits bytes / 1 GiB)."""
    if not config.tiled_logits_loss:
        return 1
    tiles = config.tiled_logits_loss_shards or math.ceil(rows * vocab_slice * 4 / LOSS_TILE_BYTES)
    return chunk_count(rows, tiles)


def tiled_mlp(forward: Callable[[torch.Tensor], torch.Tensor], module: torch.nn.Module, x: torch.Tensor,
              tiles: int) -> torch.Tensor:
    """`forward(x)` of `module` ([b, s, h] -> [b, s, h'], each token on its own) computed `tiles` tiles at a time
    by DeepSpeed's TiledMLP; `tiles` from mlp_tiles (what torch.chunk makes of b x s rows)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    def one_tile(_, tile: torch.Tensor) -> torch.Tensor:
        # the forward's tiles are [1, rows, h], the backward's [rows, h]: the MLP sees [1, rows, h] (a sequence,
        # which --sequence-parallel gathers over the TP ranks) and its output takes the tile's shape
        return forward(tile.reshape(1, -1, tile.shape[-1])).reshape(*tile.shape[:-1], -1)

    batch, seq, hidden = x.shape
    params = [param for param in module.parameters() if param.requires_grad]
    out = TiledMLP.apply(one_tile, module, x.reshape(1, batch * seq, hidden), tiles, params)
    return out.view(batch, seq, out.shape[-1])
