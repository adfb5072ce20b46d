"""One GPT-2 transformer layer: pre-LayerNorm attention and MLP, each added to the residual; or Llama's,
with the GPTConfig flags that make it (docs/model.md). The layer's recipe (megatron/model/recipe.py) picks its
norm and its MLP (an MoE layer's too); the attention is this file's.

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
    SEQUENCE_PARALLEL_RNG,
    ColumnParallelLinear,
    RNGStatesTracker,
    RowParallelLinear,
    init_method_normal,
    scaled_init_method_normal,
)
from megatron.core.tensor_parallel.mappings import group_rank, group_size
from megatron.model.config import GPTConfig
from megatron.model.kv_cache import LayerKVCache
from megatron.model.recipe import ParallelMLP, layer_recipe, norm_part  # noqa: F401 (ParallelMLP: the dense MLP)
from megatron.model.rotary import RotaryEmbedding
from megatron.model.ulysses import UlyssesAttention


def norm_class(config: GPTConfig) -> type[nn.Module]:
    """--normalization's module (the recipe's norm), sequence-parallel aware."""
    return norm_part(config).module


def layer_norm(config: GPTConfig, tp_group) -> nn.Module:
    return norm_part(config).build(config, tp_group)


class ParallelAttention(nn.Module):
    """Causal self-attention; each TP rank owns num_heads / tp whole heads and num_key_value_heads / tp K/V heads.

    The fused QKV output is laid out per K/V group as [kv_head, (q x heads / kv_heads, k, v), head_dim]
    (Megatron's GQA layout; with one K/V head per query head it is [head, (q, k, v), head_dim]), so a contiguous
    column split hands every rank complete groups.
    """

    def __init__(self, config: GPTConfig, tp_group, rng_tracker: RNGStatesTracker, sp_group=None):
        super().__init__()
        self.config = config
        self.rng_tracker = rng_tracker
        self.ulysses = UlyssesAttention(sp_group) if group_size(sp_group) > 1 else None
        self.sp_rank = group_rank(sp_group)
        self.local_heads = config.num_attention_heads // group_size(tp_group)
        self.local_kv_heads = config.num_key_value_heads // group_size(tp_group)
        self.queries_per_kv = config.num_attention_heads // config.num_key_value_heads
        bias = not config.disable_bias_linear
        # Heads differ per TP rank (and per Ulysses rank: each attends over its own heads after the all-to-all), so
        # their dropout draws from the per-rank generator (Megatron's rule); whole heads (TP=1, no sequence
        # parallelism of either kind) draw from the default generator, as the hidden dropout does.
        self.per_rank_dropout = group_size(tp_group) > 1 or config.sequence_parallel or group_size(sp_group) > 1
        self.query_key_value = ColumnParallelLinear(
            config.hidden_size, config.hidden_size + 2 * config.kv_channels, group=tp_group,
            init_method=init_method_normal(config.init_method_std), params_dtype=config.params_dtype,
            sequence_parallel=config.sequence_parallel, bias=bias,
        )
        self.dense = RowParallelLinear(
            config.hidden_size, config.hidden_size, group=tp_group,
            init_method=scaled_init_method_normal(config.init_method_std, config.num_layers),
            params_dtype=config.params_dtype, sequence_parallel=config.sequence_parallel, bias=bias,
        )
        self.rotary = (RotaryEmbedding(config.rotary_dim, config.rope_theta)
                       if config.use_rotary_position_embeddings else None)

    def _split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[b, s, (heads + 2 kv_heads) d / tp] -> q [b, heads, s, d], k and v [b, kv_heads, s, d] (this rank's)."""
        batch, seq, _ = qkv.shape
        group = self.queries_per_kv
        qkv = qkv.view(batch, seq, self.local_kv_heads, group + 2, self.config.head_dim)
        q = qkv[:, :, :, :group].reshape(batch, seq, self.local_heads, self.config.head_dim)
        return q.transpose(1, 2), qkv[:, :, :, group].transpose(1, 2), qkv[:, :, :, group + 1].transpose(1, 2)

    def forward(self, x: torch.Tensor, kv_cache: LayerKVCache | None = None) -> torch.Tensor:
        qkv = self.query_key_value(x)  # [b, s, (heads + 2 kv_heads) d / tp]: the whole sequence even when x is a slice
        batch, seq, _ = qkv.shape
        q, k, v = self._split_qkv(qkv)
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
        if self.queries_per_kv > 1:
            # each K/V head serves its group of consecutive query heads; the cache keeps the smaller K/V, the
            # attention (and DeepSpeed-Ulysses' all-to-alls, which split heads) sees one per query head
            k, v = (t.repeat_interleave(self.queries_per_kv, dim=1) for t in (k, v))
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


class ParallelTransformerLayer(nn.Module):
    def __init__(self, config: GPTConfig, tp_group, rng_tracker: RNGStatesTracker, sp_group=None,
                 experts: int = 1, expert_rank: int = 0):
        """experts: the layer's MLPs (1: dense; more: an MoE layer, megatron/model/moe.py)."""
        super().__init__()
        recipe = layer_recipe(config, experts)
        self.input_layernorm = recipe.norm.build(config, tp_group)
        self.self_attention = ParallelAttention(config, tp_group, rng_tracker, sp_group)
        self.post_attention_layernorm = recipe.norm.build(config, tp_group)
        self.mlp = recipe.build_mlp(tp_group, expert_rank)
        self.hidden_dropout = nn.Dropout(config.hidden_dropout)
        self.sequence_parallel = config.sequence_parallel
        self.ulysses_slice = group_size(sp_group) > 1  # this rank holds a DeepSpeed-Ulysses slice
        self.rng_tracker = rng_tracker

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        # Replicated residual-branch outputs use the default generator (the same mask on every TP
        # rank); sequence slices differ per rank, so they draw from the per-rank generator: Megatron's slices
        # (over TP) from the model-parallel one, Ulysses' (over SP, replicated over TP) from the sequence one.
        if self.sequence_parallel:
            stream = self.rng_tracker.fork(x.device)
        elif self.ulysses_slice:
            stream = self.rng_tracker.fork(x.device, SEQUENCE_PARALLEL_RNG)
        else:
            return self.hidden_dropout(x)
        with stream:
            return self.hidden_dropout(x)

    def forward(self, x: torch.Tensor, kv_cache: LayerKVCache | None = None) -> torch.Tensor:
        assert not (self.sequence_parallel and kv_cache is not None), "the KV cache is for serial decoding"
        x = x + self._dropout(self.self_attention(self.input_layernorm(x), kv_cache))
        return x + self._dropout(self.mlp(self.post_attention_layernorm(x)))
