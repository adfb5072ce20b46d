"""DeepSpeed-Ulysses attention: each rank of a sequence-parallel group of N holds 1/N of every sequence.

DeepSpeed's DistributedAttention all-to-alls q, k and v from sequence-sharded [b, s/N, heads, d] to head-sharded
[b, s, heads/N, d], so that each rank runs causal attention over the WHOLE sequence for its heads, then all-to-alls
the output back to [b, s/N, heads, d]: 4 all-to-alls per layer and pass (the backward reverses each). The
collectives are DeepSpeed's; this file only lays the tensors out for it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _WholeSequenceAttention(nn.Module):
    """Causal SDPA for this rank's heads over the whole sequence, in DistributedAttention's [b, s, heads, d]."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True).transpose(1, 2)


class UlyssesAttention(nn.Module):
    """Causal attention over sequences split across `group` (a torch.distributed group of N ranks)."""

    def __init__(self, group):
        super().__init__()
        from deepspeed.sequence.layer import DistributedAttention

        # batch-first: heads (dim 2) are scattered and the sequence (dim 1) gathered
        self.attention = DistributedAttention(_WholeSequenceAttention(), group, scatter_idx=2, gather_idx=1)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
        """q, k, v: [b, heads, s/N, d], this rank's slice; returns the attention output in the same layout."""
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return self.attention(q, k, v, 0, None, dropout_p).transpose(1, 2)
