"""Rotary position embeddings (RoFormer), applied as GPT-NeoX and Megatron-DeepSpeed apply them.

Each query and key head has its first rotary_dim dimensions rotated in pairs (i, i + rotary_dim / 2, the
"rotate half" layout) by the angle position x base^(-2i / rotary_dim); the rest pass unchanged. Attention
scores then depend on the distance between positions only, so the model has no learned position table.
The angles are computed and applied in fp32 (bf16 cannot tell position 1000 from 1004), then cast back.
"""
from __future__ import annotations

import torch
from torch import nn

ROTARY_BASE = 10000.0


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class RotaryEmbedding(nn.Module):
    """cos and sin of the angles of the positions a call rotates, [positions, rotary_dim] in fp32, computed on the
    device of the tensors they rotate at every call and not kept by the module: the backward keeps them until it
    has run, and nothing outlives the step (a cache would hold them between steps too, and a cache from position 0
    would make the last DeepSpeed-Ulysses rank hold the whole sequence's angles in every layer). Computing them is
    t x rotary_dim / 2 multiplications and t x rotary_dim cos and sin per layer, next to the attention's t^2.
    No parameters and no buffers: nothing enters the state dict, and casting the model to bf16 leaves the
    angles fp32."""

    def __init__(self, rotary_dim: int, base: float = ROTARY_BASE):
        super().__init__()
        assert rotary_dim >= 2 and rotary_dim % 2 == 0, f"expected an even rotary_dim >= 2, got {rotary_dim}"
        self.rotary_dim = rotary_dim
        self.base = base  # --rope-theta

    def _angles(self, first_position: int, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32, device=device) / self.rotary_dim
        inverse_frequencies = self.base ** -exponents
        positions = torch.arange(first_position, first_position + length, dtype=torch.float32, device=device)
        angles = torch.outer(positions, inverse_frequencies).repeat(1, 2)  # [positions, rotary_dim]
        return angles.cos(), angles.sin()

    def forward(self, x: torch.Tensor, first_position: int) -> torch.Tensor:
        """x: [batch, heads, seq, head_dim] at positions first_position .. first_position + seq - 1."""
        return self._rotate(x, *self._angles(first_position, x.shape[2], x.device))

    def pair(self, q: torch.Tensor, k: torch.Tensor, first_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k at the same positions, rotated by one cos and sin (which the backward keeps once)."""
        cos, sin = self._angles(first_position, q.shape[2], q.device)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rotated, passed = x[..., :self.rotary_dim].float(), x[..., self.rotary_dim:]
        rotated = rotated * cos + rotate_half(rotated) * sin
        return torch.cat((rotated.to(x.dtype), passed), dim=-1)
