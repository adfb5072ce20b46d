"""GPT-2: learned positions (or rotary ones, applied in the attention), pre-LN transformer layers, final LayerNorm, tied output layer.
Llama (docs/model.md): rotary positions, RMSNorm, a gated SiLU MLP, grouped-query attention and an untied output
layer.

The model is built for one tensor-parallel group (None = serial), and a DeepSpeed-Ulysses sequence-parallel group
(None = whole sequences; with one, input_ids are this rank's slice at its global position_ids), and returns per-token
fp32 losses computed by the vocab-parallel cross-entropy, or the full logits.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from megatron.core.scratch import ScratchBuffers
from megatron.core.tensor_parallel import (
    SEQUENCE_PARALLEL_RNG,
    VocabParallelEmbedding,
    checkpoint,
    gather_from_tensor_model_parallel_region,
    init_method_normal,
    lm_head_input,
    model_parallel_tracker,
    parallel_lm_logits,
    scatter_to_sequence_parallel_region,
    vocab_parallel_lm_loss,
)
from megatron.core.tensor_parallel.layers import _sharded_weight, fp32_cpu_init
from megatron.core.tensor_parallel.mappings import group_rank, group_size
from megatron.core.tensor_parallel.random import RNGStatesTracker
from megatron.model.config import GPTConfig, check_parallel_shape
from megatron.model.kv_cache import KVCache
from megatron.model.tiling import loss_tiles
from megatron.model.transformer import ParallelTransformerLayer, layer_norm


def build_embeddings(config: GPTConfig, tp_group) -> tuple[VocabParallelEmbedding, nn.Embedding | None]:
    """Word embeddings (split over the vocab; also the tied output layer) and learned positions (None with
    rotary positions, which the attention applies)."""
    init = init_method_normal(config.init_method_std)
    words = VocabParallelEmbedding(config.padded_vocab_size, config.hidden_size, group=tp_group,
                                   init_method=init, params_dtype=config.params_dtype)
    if config.use_rotary_position_embeddings:
        return words, None
    # _weight skips nn.Embedding's own N(0, 1) draw, so construction uses the RNG exactly once.
    positions = fp32_cpu_init((config.max_position_embeddings, config.hidden_size), init)
    return words, nn.Embedding(config.max_position_embeddings, config.hidden_size,
                               _weight=positions.to(config.params_dtype))


class OutputLayer(nn.Module):
    """--untie-embeddings-and-output-weights: the output layer's own [padded_vocab, h] weight, split by vocabulary
    rows over the TP group as the word embeddings are (Megatron's output_layer)."""

    def __init__(self, config: GPTConfig, tp_group):
        super().__init__()
        self.weight = _sharded_weight((config.padded_vocab_size, config.hidden_size), 0, tp_group,
                                      init_method_normal(config.init_method_std), config.params_dtype)


def output_layer_seed_index(config: GPTConfig) -> int:
    """The untied output layer's init seed index, after the embeddings' (0) and the layers' (1..L)."""
    return config.num_layers + 1


@contextlib.contextmanager
def layer_init_seed(base_seed: int, index: int):
    """Draw layer `index`'s initial weights from its own seed (embeddings 0, transformer layer i
    at i + 1), leaving the caller's generators as they were: a pipeline stage builds only its own
    layers, and still gets exactly the weights the whole model built in one process has."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed((base_seed + index) % 2**63)
        yield


def embed(words: VocabParallelEmbedding, positions: nn.Embedding | None, dropout: nn.Dropout, input_ids: torch.Tensor,
          position_ids: torch.Tensor, config: GPTConfig, tp_group, rng_tracker: RNGStatesTracker,
          ulysses: bool = False) -> torch.Tensor:
    """Word + position embeddings after dropout: [b, s, h], or this rank's [b, s / tp, h] sequence
    slice with sequence parallelism (whose dropout then differs per rank, so it uses the tracker). `ulysses`:
    input_ids are this rank's slice of a DeepSpeed-Ulysses group, whose masks differ per SP rank too."""
    x = words(input_ids) if positions is None else words(input_ids) + positions(position_ids)
    if config.sequence_parallel:
        x = scatter_to_sequence_parallel_region(x, tp_group)
        with rng_tracker.fork(x.device):
            return dropout(x)
    with rng_tracker.fork(x.device, SEQUENCE_PARALLEL_RNG) if ulysses else contextlib.nullcontext():
        return dropout(x)


class GPTModel(nn.Module):
    def __init__(self, config: GPTConfig, tp_group=None, sp_group=None, expert_rank: int = 0):
        """expert_rank: this rank's place in its expert-parallel group (megatron/model/moe.py)."""
        super().__init__()
        check_parallel_shape(config, group_size(tp_group))
        self.config = config
        self.tp_group = tp_group
        # Per-TP-rank dropout stream and per-layer init seeds, from the seed given to torch.manual_seed.
        seed = torch.initial_seed()
        self.rng_tracker = model_parallel_tracker(seed % 2**62, group_rank(tp_group), group_rank(sp_group),
                                                  group_size(tp_group))
        self.ulysses_slice = group_size(sp_group) > 1  # this rank holds a DeepSpeed-Ulysses slice
        with layer_init_seed(seed, 0):
            self.word_embeddings, self.position_embeddings = build_embeddings(config, tp_group)
        self.embedding_dropout = nn.Dropout(config.hidden_dropout)
        self.layers = nn.ModuleList()
        for index, experts in enumerate(config.layer_experts):
            with layer_init_seed(seed, index + 1):
                self.layers.append(ParallelTransformerLayer(config, tp_group, self.rng_tracker, sp_group, experts,
                                                            expert_rank))
        self.final_layernorm = layer_norm(config, tp_group)
        self.output_layer = None
        if config.untie_embeddings_and_output_weights:
            with layer_init_seed(seed, output_layer_seed_index(config)):
                self.output_layer = OutputLayer(config, tp_group)
        self.lm_loss_scratch = ScratchBuffers()  # the [tokens, vocab] logits buffer, reused each step

    def output_weight(self) -> nn.Parameter:
        """The output layer's weight: the word embeddings' unless they are untied. The model reads it outside the
        forward of the module that holds it (ZeRO-3 under --compile needs to know: megatron/engine.py)."""
        return (self.word_embeddings if self.output_layer is None else self.output_layer).weight

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor | None = None,
                kv_cache: KVCache | None = None):
        """input_ids, position_ids, labels: [batch, seq] long. Returns the per-token fp32 loss
        [batch, seq] when labels are given, else the logits [batch, seq, padded_vocab].
        With kv_cache, input_ids are the positions after those already in the cache (decoding).
        Rotary positions are those of the chunk, after the cache's: position_ids feed the learned table only."""
        assert input_ids.dim() == 2 and input_ids.shape == position_ids.shape, (
            f"expected input_ids and position_ids of one shape [batch, seq], got "
            f"{tuple(input_ids.shape)} and {tuple(position_ids.shape)}"
        )
        x = embed(self.word_embeddings, self.position_embeddings, self.embedding_dropout, input_ids, position_ids,
                  self.config, self.tp_group, self.rng_tracker, self.ulysses_slice)
        recompute = self.config.recompute_activations and self.training and torch.is_grad_enabled()
        assert not (recompute and kv_cache is not None), "the KV cache is for inference, not recomputed training"
        for index, layer in enumerate(self.layers):
            if recompute:
                x = checkpoint(layer, self.rng_tracker, x, with_deepspeed=self.config.recompute_with_deepspeed,
                               offload=self.config.recompute_offload)
            else:
                x = layer(x, None if kv_cache is None else kv_cache.layer(index))
        if kv_cache is not None:
            kv_cache.advance(input_ids.shape[1])
        x = self.final_layernorm(x)
        weight = self.output_weight()
        if labels is None:
            local_logits = parallel_lm_logits(x, weight, self.tp_group, self.config.sequence_parallel)
            return gather_from_tensor_model_parallel_region(local_logits, self.tp_group)
        tiles = loss_tiles(self.config, labels.numel(), self.config.padded_vocab_size // group_size(self.tp_group))
        return vocab_parallel_lm_loss(lm_head_input(x, self.tp_group, self.config.sequence_parallel),
                                      weight, labels, self.tp_group, self.lm_loss_scratch, tiles)
