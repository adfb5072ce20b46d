"""One GPT-2 transformer layer: pre-LayerNorm attention and MLP, each added to the residual.

The tensor-parallel layers carry all communication; this file has no collective calls.
Activations are [batch, seq, hidden]; with sequence parallelism the residual stream outside
the attention and MLP is [batch, seq / tp, hidden] on each rank. With DeepSpeed-Ulysses (sp_group of N ranks)
every activation is [batch, seq / N, hidden]: only the attention sees whole sequences (megatron/model/ulysses.py).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RNGStatesTracker,
    RowParallelLinear,
    SequenceParallelLayerNorm,
    init_method_normal,
    scaled_init_method_normal,
)
from megatron.core.tensor_parallel.mappings import group_rank, group_size
from megatron.model.config import GPTConfig
from megatron.model.kv_cache import LayerKVCache
from megatron.model.rotary import RotaryEmbedding
from megatron.model.ulysses import UlyssesAttention


def layer_norm(config: GPTConfig, tp_group) -> SequenceParallelLayerNorm:
    return SequenceParallelLayerNorm(config.hidden_size, eps=config.layernorm_epsilon, group=tp_group,
                                     sequence_parallel=config.sequence_parallel, params_dtype=config.params_dtype)


class ParallelAttention(nn.Module):
    """Causal self-attention; each TP rank owns num_heads / tp whole heads.

    The fused QKV output is laid out per head as [head, (q, k, v), head_dim] (Megatron's
    layout), so a contiguous column split hands every rank complete heads.
    """

    def __init__(self, config: GPTConfig, tp_group, rng_tracker: RNGStatesTracker, sp_group=None):
        super().__init__()
        self.config = config
        self.rng_tracker = rng_tracker
        self.ulysses = UlyssesAttention(sp_group) if group_size(sp_group) > 1 else None
        self.sp_rank = group_rank(sp_group)
        self.local_heads = config.num_attention_heads // group_size(tp_group)
        # Heads differ per TP rank, so their dropout draws from the per-rank generator (Megatron's rule); whole
        # heads (TP=1, no sequence parallelism) draw from the default generator, as the hidden dropout does.
        self.per_rank_dropout = group_size(tp_group) > 1 or config.sequence_parallel
        self.query_key_value = ColumnParallelLinear(
            config.hidden_size, 3 * config.hidden_size, group=tp_group,
            init_method=init_method_normal(config.init_method_std), params_dtype=config.params_dtype,
            sequence_parallel=config.sequence_parallel,
        )
        self.dense = RowParallelLinear(
            config.hidden_size, config.hidden_size, group=tp_group,
            init_method=scaled_init_method_normal(config.init_method_std, config.num_layers),
            params_dtype=config.params_dtype, sequence_parallel=config.sequence_parallel,
        )
        self.rotary = RotaryEmbedding(config.rotary_dim) if config.use_rotary_position_embeddings else None

    def forward(self, x: torch.Tensor, kv_cache: LayerKVCache | None = None) -> torch.Tensor:
        qkv = self.query_key_value(x)  # [b, s, 3 h / tp]: the whole sequence even when x is a slice
        batch, seq, _ = qkv.shape
        qkv = qkv.view(batch, seq, self.local_heads, 3, self.config.head_dim)
        q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))  # each [b, heads, s, d]
        assert not (self.ulysses is not None and kv_cache is not None), "the KV cache is for serial decoding"
        # the chunk's first position: after the cache's, or this rank's slice start under Ulysses
        past = kv_cache.past_length if kv_cache is not None else self.sp_rank * seq
        if self.rotary is not None:
            # the chunk holds positions past .. past + seq - 1 (decoding step t is position t), before its
            # keys join the cache: cached keys keep the rotation of their own positions
            q, k = self.rotary.pair(q, k, past)
        mask = None
        if kv_cache is not None:
            k, v = kv_cache.update(k, v)
            # query i sits at position past + i and sees keys 0..past + i (SDPA's is_causal
            # aligns the triangle top-left, which is only right without a cached prefix)
            mask = torch.ones(seq, past + seq, dtype=torch.bool, device=x.device).tril(diagonal=past)
        dropout = self.config.attention_dropout if self.training else 0.0
        # The fork swaps generator states, which breaks a --compile graph; at TP=1 (or with nothing to draw:
        # eval, --attention-dropout 0) there is no swap. Every ZeRO stage draws the same default-generator masks.
        fork = self.per_rank_dropout and dropout > 0
        with self.rng_tracker.fork(x.device) if fork else contextlib.nullcontext():
            if self.ulysses is not None:
                context = self.ulysses(q, k, v, dropout)
            else:
                context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                         is_causal=mask is None)
        context = context.transpose(1, 2).reshape(batch, seq, self.local_heads * self.config.head_dim)
        return self.dense(context)


class ParallelMLP(nn.Module):
    """h -> ffn (column split) -> GELU(tanh) -> h (row split)."""

    def __init__(self, config: GPTConfig, tp_group):
        super().__init__()
        self.dense_h_to_4h = ColumnParallelLinear(
            config.hidden_size, config.ffn_hidden_size, group=tp_group,
            init_method=init_method_normal(config.init_method_std), params_dtype=config.params_dtype,
            sequence_parallel=config.sequence_parallel,
        )
        self.dense_4h_to_h = RowParallelLinear(
            config.ffn_hidden_size, config.hidden_size, group=tp_group,
            init_method=scaled_init_method_normal(config.init_method_std, config.num_layers),
            params_dtype=config.params_dtype, sequence_parallel=config.sequence_parallel,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x), approximate="tanh"))


class ParallelTransformerLayer(nn.Module):
    def __init__(self, config: GPTConfig, tp_group, rng_tracker: RNGStatesTracker, sp_group=None):
        super().__init__()
        self.input_layernorm = layer_norm(config, tp_group)
        self.self_attention = ParallelAttention(config, tp_group, rng_tracker, sp_group)
        self.post_attention_layernorm = layer_norm(config, tp_group)
        self.mlp = ParallelMLP(config, tp_group)
        self.hidden_dropout = nn.Dropout(config.hidden_dropout)
        self.sequence_parallel = config.sequence_parallel
        self.rng_tracker = rng_tracker

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        # Replicated residual-branch outputs use the default generator (the same mask on every TP
        # rank); sequence slices differ per rank, so they draw from the per-rank generator.
        if not self.sequence_parallel:
            return self.hidden_dropout(x)
        with self.rng_tracker.fork(x.device):
            return self.hidden_dropout(x)

    def forward(self, x: torch.Tensor, kv_cache: LayerKVCache | None = None) -> torch.Tensor:
        assert not (self.sequence_parallel and kv_cache is not None), "the KV cache is for serial decoding"
        x = x + self._dropout(self.self_attention(self.input_layernorm(x), kv_cache))
        return x + self._dropout(self.mlp(self.post_attention_layernorm(x)))
