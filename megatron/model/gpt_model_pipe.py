"""GPT-2 in DeepSpeed's pipeline form: the same layers as GPTModel, as a PipelineModule.

Stage 0 embeds, the transformer layers are split evenly over the stages, the last stage
applies the final LayerNorm and the output layer, which is the word embedding shared
with stage 0 (a TiedLayerSpec: DeepSpeed syncs the weight and sums its gradients); with
--untie-embeddings-and-output-weights the last stage holds the output layer's own weight instead.
The output layer's matrix product happens inside the loss (vocab_parallel_lm_loss, as in
GPTModel): the last layer hands the loss function the hidden state and the tied weight.
Batches for `engine.train_batch` are ((tokens, position_ids), (labels, loss_mask)).
"""
from __future__ import annotations

import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from torch import nn

from megatron.core.parallel_state import ParallelState
from megatron.core.scratch import ScratchBuffers
from megatron.core.tensor_parallel import (
    checkpoint,
    lm_head_input,
    model_parallel_tracker,
    vocab_parallel_lm_loss,
)
from megatron.core.tensor_parallel.mappings import group_size
from megatron.core.tensor_parallel.random import RNGStatesTracker
from megatron.model.config import GPTConfig, check_parallel_shape
from megatron.model.gpt_model import OutputLayer, build_embeddings, embed, layer_init_seed, output_layer_seed_index
from megatron.model.tiling import loss_tiles
from megatron.model.transformer import ParallelTransformerLayer, norm_class


class EmbeddingPipe(nn.Module):
    def __init__(self, config: GPTConfig, tp_group, rng_tracker: RNGStatesTracker, init_seed: int):
        super().__init__()
        self.config = config
        self.tp_group = tp_group
        self.rng_tracker = rng_tracker
        with layer_init_seed(init_seed, 0):
            self.word_embeddings, self.position_embeddings = build_embeddings(config, tp_group)
        self.embedding_dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        tokens, position_ids = inputs
        return embed(self.word_embeddings, self.position_embeddings, self.embedding_dropout, tokens, position_ids,
                     self.config, self.tp_group, self.rng_tracker)


def lm_head(embedding: EmbeddingPipe, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tied output layer on the last stage, for the loss: (hidden as the vocab-parallel
    layer takes it, this rank's vocab slice of the word embeddings)."""
    return (lm_head_input(hidden, embedding.tp_group, embedding.config.sequence_parallel),
            embedding.word_embeddings.weight)


class OutputLayerPipe(nn.Module):
    """The untied output layer on the last stage (saved as its own layer file, keys output_layer.*)."""

    def __init__(self, config: GPTConfig, tp_group, init_seed: int):
        super().__init__()
        self.config = config
        self.tp_group = tp_group
        with layer_init_seed(init_seed, output_layer_seed_index(config)):
            self.output_layer = OutputLayer(config, tp_group)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (lm_head_input(hidden, self.tp_group, self.config.sequence_parallel), self.output_layer.weight)


class TransformerLayerPipe(ParallelTransformerLayer):
    """A transformer layer that recomputes itself in backward when the config asks for it."""

    def __init__(self, config: GPTConfig, tp_group, rng_tracker: RNGStatesTracker, init_seed: int, index: int):
        with layer_init_seed(init_seed, index + 1):
            super().__init__(config, tp_group, rng_tracker)
        self.recompute, self.with_deepspeed = config.recompute_activations, config.recompute_with_deepspeed
        self.offload = config.recompute_offload
        self.rng_tracker = rng_tracker

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute and self.training and torch.is_grad_enabled():
            return checkpoint(super().forward, self.rng_tracker, x, with_deepspeed=self.with_deepspeed,
                              offload=self.offload)
        return super().forward(x)


class MaskedLMLoss:
    """Mean per-token loss over the tokens whose loss_mask is 1 (the pipeline's loss_fn)."""

    def __init__(self, config: GPTConfig, tp_group):
        self.config, self.tp_group = config, tp_group
        self.scratch = ScratchBuffers()  # the [tokens, vocab] logits buffer, reused each step

    def __call__(self, head: tuple[torch.Tensor, torch.Tensor],
                 targets: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        hidden, weight = head
        labels, loss_mask = targets
        tiles = loss_tiles(self.config, labels.numel(), self.config.padded_vocab_size // group_size(self.tp_group))
        losses = vocab_parallel_lm_loss(hidden, weight, labels, self.tp_group, self.scratch, tiles)
        mask = loss_mask.to(losses.dtype)
        return (losses * mask).sum() / mask.sum().clamp(min=1.0)


def build_gpt_pipe(config: GPTConfig, state: ParallelState) -> PipelineModule:
    """A PipelineModule over `state`'s layout (rank order pipe > data > tensor, as Megatron).
    Needs deepspeed.init_distributed() first; pass the module to deepspeed.initialize without mpu
    (the PipelineModule brings its own grid with the same groups)."""
    tp_group = state.get_tensor_model_parallel_group()
    layout = state.layout
    check_parallel_shape(config, layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size)
    seed = torch.initial_seed()
    tracker = model_parallel_tracker(seed % 2**62, state.get_tensor_model_parallel_rank())
    untied = config.untie_embeddings_and_output_weights
    embedding = (LayerSpec(EmbeddingPipe, config, tp_group, tracker, seed) if untied else
                 TiedLayerSpec("embed", EmbeddingPipe, config, tp_group, tracker, seed,
                               tied_weight_attr="word_embeddings.weight"))
    output = (LayerSpec(OutputLayerPipe, config, tp_group, seed) if untied else
              TiedLayerSpec("embed", EmbeddingPipe, config, tp_group, tracker, seed, forward_fn=lm_head,
                            tied_weight_attr="word_embeddings.weight"))
    specs = [
        embedding,
        *[LayerSpec(TransformerLayerPipe, config, tp_group, tracker, seed, index) for index in range(config.num_layers)],
        LayerSpec(norm_class(config), config.hidden_size, eps=config.layernorm_epsilon, group=tp_group,
                  sequence_parallel=config.sequence_parallel, params_dtype=config.params_dtype),
        output,
    ]
    topology = PipeModelDataParallelTopology(num_pp=layout.pipeline_model_parallel_size,
                                             num_mp=layout.tensor_model_parallel_size,
                                             num_dp=layout.data_parallel_size)
    module = PipelineModule(layers=specs, loss_fn=MaskedLMLoss(config, tp_group), topology=topology,
                            partition_method="type:TransformerLayerPipe")
    module.rng_tracker = tracker  # saved and restored with checkpoints, as GPTModel's
    return module
