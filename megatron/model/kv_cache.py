"""Key/value cache for incremental decoding: each new token attends to the stored keys and
values of the positions before it, so a step computes one position instead of the whole prefix."""
from __future__ import annotations

import torch


class KVCache:
    """Per-layer keys and values [batch, local_heads, max_length, head_dim].

    Buffers are allocated on first use, at max_length, with the shape, dtype and device of the
    attention's keys (so the tensor-parallel head split needs no knowledge here); a step writes
    into them in place. GPTModel.forward calls `advance` once all layers have stored a chunk.
    """

    def __init__(self, num_layers: int, max_length: int):
        self.max_length = max_length
        self.length = 0  # positions already stored in every layer
        self._keys: list[torch.Tensor | None] = [None] * num_layers
        self._values: list[torch.Tensor | None] = [None] * num_layers

    def layer(self, index: int) -> "LayerKVCache":
        return LayerKVCache(self, index)

    def advance(self, num_positions: int) -> None:
        self.length += num_positions


class LayerKVCache:
    """One layer's view of a KVCache, handed to its attention."""

    def __init__(self, cache: KVCache, index: int):
        self.cache = cache
        self.index = index

    @property
    def past_length(self) -> int:
        return self.cache.length

    def update(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this chunk's keys/values [b, heads, s, d]; return those of all positions so far."""
        cache, start = self.cache, self.cache.length
        end = start + keys.shape[2]
        if end > cache.max_length:
            raise ValueError(f"KV cache holds {cache.max_length} positions; {end} requested")
        if cache._keys[self.index] is None:
            shape = (*keys.shape[:2], cache.max_length, keys.shape[3])
            cache._keys[self.index] = keys.new_empty(shape)
            cache._values[self.index] = values.new_empty(shape)
        stored_k, stored_v = cache._keys[self.index], cache._values[self.index]
        stored_k[:, :, start:end] = keys
        stored_v[:, :, start:end] = values
        return stored_k[:, :, :end], stored_v[:, :, :end]
