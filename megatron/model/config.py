"""GPTConfig: the model's shape and regularisation, validated with Megatron flag names."""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from megatron.errors import ZeroLabError
from megatron.layout_check import expert_parallel_problems

_PARAMS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NORMALIZATIONS = ("layernorm", "rmsnorm")


# GPTConfig's fields that are a run's choice, not the model's: checkpoints do not store them
RUN_FIELDS = ("params_dtype", "moe_expert_parallel_size", "recompute_with_deepspeed", "recompute_offload",
              "tiled_mlp_compute", "tiled_mlp_shards", "tiled_logits_loss", "tiled_logits_loss_shards")


class ModelConfigError(ZeroLabError, ValueError):
    """An inconsistent model shape; the message names the Megatron flag."""


@dataclass
class GPTConfig:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    max_position_embeddings: int
    # the tokenizer's vocabulary padded for TP; None until the start-up step has read the tokenizer files
    padded_vocab_size: int | None
    ffn_hidden_size: int | None = None
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    layernorm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    # Megatron's --checkpoint-activations: recompute each layer's activations in the backward pass
    recompute_activations: bool = False
    # --deepspeed-activation-checkpointing: that recompute runs through deepspeed.checkpointing (a run's choice, not
    # the model's: checkpoints do not store it)
    recompute_with_deepspeed: bool = False
    # --checkpoint-in-cpu with zero-lab's own recompute: each layer's input waits in host memory until its recompute
    # (megatron/core/tensor_parallel/activation_offload.py; a run's choice, not stored either)
    recompute_offload: bool = False
    params_dtype: torch.dtype = torch.float32
    # Megatron's --sequence-parallel: LayerNorm/dropout regions split along the sequence over the TP group.
    sequence_parallel: bool = False
    # Megatron-DeepSpeed's rotary positions: q and k rotated by position-dependent angles, no learned table
    use_rotary_position_embeddings: bool = False
    # the fraction of each head's dimensions rotated (the rest pass unchanged), as Megatron-DeepSpeed's flag
    rotary_percent: float = 1.0
    # the rotary angles' base (Megatron-DeepSpeed's --rope-theta; Llama 3 uses 500000)
    rope_theta: float = 10000.0
    # Llama's architecture, each behind its Megatron-DeepSpeed flag (docs/model.md): --normalization rmsnorm,
    # --swiglu (SiLU-gated MLP of three matrices), --num-key-value-heads (grouped-query attention; None: one per
    # query head), --untie-embeddings-and-output-weights (the output layer's own weight), --disable-bias-linear
    normalization: str = "layernorm"
    swiglu: bool = False
    # Megatron-LM's --squared-relu: the MLP's activation relu(x)^2 (Primer, Nemotron-4) instead of GELU
    squared_relu: bool = False
    num_key_value_heads: int | None = None
    untie_embeddings_and_output_weights: bool = False
    disable_bias_linear: bool = False
    # Megatron-DeepSpeed's mixture of experts (DeepSpeed's MoE layer in the MLP; megatron/model/moe.py): experts
    # per MoE layer, one value or one per MoE layer; every expert_interval-th layer is one (1: dense)
    num_experts: list[int] = field(default_factory=lambda: [1])
    expert_interval: int = 2
    moe_expert_parallel_size: int = 1  # the run's layout, not the model's: checkpoints do not store it
    topk: int = 1
    moe_train_capacity_factor: float = 1.0
    moe_eval_capacity_factor: float = 1.0
    moe_min_capacity: int = 4
    moe_token_dropping: bool = True  # --disable-moe-token-dropping turns it off
    mlp_type: str = "standard"  # residual: PR-MoE's dense MLP beside the experts
    # ALST's tiling along the sequence (docs/long-sequences.md), a run's choice (checkpoints do not store it): the
    # MLP computed a tile of tokens at a time and recomputed in the backward (ArcticTraining's tiled_mlp_compute),
    # and the output layer's logits and loss likewise; shards 0: as ALST picks them (megatron/model/tiling.py)
    tiled_mlp_compute: bool = field(default=False, metadata=dict(help=(
        "compute each MLP over --tiled-mlp-shards tiles of the sequence, keeping only its input for the backward, "
        "which recomputes it tile by tile (ALST's tiled MLP)")))
    tiled_mlp_shards: int = field(default=0, metadata=dict(help=(
        "tiles of --tiled-mlp-compute; 0: ceil(the rank's tokens per sequence / --hidden-size), as ALST")))
    tiled_logits_loss: bool = field(default=False, metadata=dict(help=(
        "compute the output layer's logits and loss over --tiled-logits-loss-shards tiles of the tokens, one "
        "tile's [tokens, vocab / TP] buffer at a time; the backward recomputes each tile's logits")))
    tiled_logits_loss_shards: int = field(default=0, metadata=dict(help=(
        "tiles of --tiled-logits-loss; 0: as ALST, tiles of about 1 GiB of fp32 logits")))

    def __post_init__(self):
        if self.ffn_hidden_size is None:
            # SwiGLU's three matrices at 2/3 of 4h hold what GELU's two at 4h do (Megatron's default, a multiple of 64)
            self.ffn_hidden_size = int(4 * self.hidden_size * 2 / 3 / 64) * 64 if self.swiglu else 4 * self.hidden_size
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        for flag, value in (
            ("--num-layers", self.num_layers),
            ("--hidden-size", self.hidden_size),
            ("--num-attention-heads", self.num_attention_heads),
            ("--seq-length", self.seq_length),
            ("--max-position-embeddings", self.max_position_embeddings),
            ("padded vocab size", self.padded_vocab_size),
            ("--ffn-hidden-size", self.ffn_hidden_size),
        ):
            if value is None and flag == "padded vocab size":
                continue
            if not isinstance(value, int) or value < 1:
                raise ModelConfigError(f"{flag} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ModelConfigError(
                f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads {self.num_attention_heads}"
            )
        if self.seq_length > self.max_position_embeddings:
            raise ModelConfigError(
                f"--seq-length {self.seq_length} exceeds --max-position-embeddings {self.max_position_embeddings}"
            )
        for flag, value in (("--hidden-dropout", self.hidden_dropout), ("--attention-dropout", self.attention_dropout)):
            if not 0.0 <= value < 1.0:
                raise ModelConfigError(f"{flag} must be in [0, 1), got {value}")
        if self.layernorm_epsilon <= 0:
            raise ModelConfigError(f"--layernorm-epsilon must be > 0, got {self.layernorm_epsilon}")
        if self.init_method_std <= 0:
            raise ModelConfigError(f"--init-method-std must be > 0, got {self.init_method_std}")
        self._check_rotary()
        self._check_llama()
        self._check_moe()
        self._check_tiling()
        if self.params_dtype not in _PARAMS_DTYPES:
            raise ModelConfigError(f"params dtype must be one of float32, bfloat16, float16, got {self.params_dtype}")

    def _check_rotary(self) -> None:
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ModelConfigError(f"--rotary-percent must be in (0, 1], got {self.rotary_percent}")
        if self.use_rotary_position_embeddings and (self.rotary_dim < 2 or self.rotary_dim % 2):
            # rotate-half pairs dimension i with i + rotary_dim / 2, so the rotated part has an even width
            raise ModelConfigError(f"--rotary-percent {self.rotary_percent} rotates {self.rotary_dim} of each head's "
                                   f"{self.head_dim} dimensions; it must be an even number >= 2")

    def _check_llama(self) -> None:
        if self.normalization not in NORMALIZATIONS:
            raise ModelConfigError(f"--normalization must be one of {', '.join(NORMALIZATIONS)}, "
                                   f"got {self.normalization!r}")
        if not isinstance(self.num_key_value_heads, int) or self.num_key_value_heads < 1:
            raise ModelConfigError(
                f"--num-key-value-heads must be a positive integer, got {self.num_key_value_heads!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError(f"--num-attention-heads {self.num_attention_heads} is not divisible by "
                                   f"--num-key-value-heads {self.num_key_value_heads}: each K/V head serves a whole "
                                   "group of query heads")
        if self.rope_theta <= 0:
            raise ModelConfigError(f"--rope-theta must be > 0, got {self.rope_theta}")
        if self.swiglu and self.squared_relu:
            raise ModelConfigError("--squared-relu and --swiglu each pick the MLP's activation: give one of them")

    def _check_moe(self) -> None:
        counts, interval = self.num_experts, self.expert_interval
        if not counts or any(not isinstance(n, int) or n < 1 for n in counts):
            raise ModelConfigError(f"--num-experts must be positive integers, got {counts}")
        if not isinstance(interval, int) or interval < 1:
            raise ModelConfigError(f"--expert-interval must be a positive integer, got {interval!r}")
        if len(counts) not in (1, self.num_layers // interval):
            raise ModelConfigError(f"--num-experts gives {len(counts)} values: give one, or one per MoE layer "
                                   f"(--num-layers {self.num_layers} // --expert-interval {interval} = "
                                   f"{self.num_layers // interval})")
        for flag, value in (("--moe-train-capacity-factor", self.moe_train_capacity_factor),
                            ("--moe-eval-capacity-factor", self.moe_eval_capacity_factor)):
            if value <= 0:
                raise ModelConfigError(f"{flag} must be > 0, got {value}")
        if self.moe_min_capacity < 0:
            raise ModelConfigError(f"--moe-min-capacity must be >= 0, got {self.moe_min_capacity}")
        if self.mlp_type not in ("standard", "residual"):
            raise ModelConfigError(f"--mlp-type must be standard or residual, got {self.mlp_type!r}")
        moe = [n for n in self.layer_experts if n > 1]
        if moe and not 1 <= self.topk <= min(moe):
            raise ModelConfigError(f"--topk {self.topk} must be from 1 to the fewest experts of a layer ({min(moe)})")
        ep = self.moe_expert_parallel_size
        if ep < 1:
            raise ModelConfigError(f"--moe-expert-parallel-size must be >= 1, got {ep}")
        problems = expert_parallel_problems(moe, ep)  # the launch planner's check too
        if problems:
            raise ModelConfigError(problems[0])

    def _check_tiling(self) -> None:
        for flag, value in (("--tiled-mlp-shards", self.tiled_mlp_shards),
                            ("--tiled-logits-loss-shards", self.tiled_logits_loss_shards)):
            if not isinstance(value, int) or value < 0:
                raise ModelConfigError(f"{flag} must be an integer >= 0 (0: as ALST picks), got {value!r}")
        if self.tiled_mlp_compute and self.is_moe:
            # DeepSpeed's MoE layer sizes its experts' capacity by the tokens of each call: tiles would route
            # differently from the whole sequence
            raise ModelConfigError(f"--tiled-mlp-compute cannot be combined with MoE layers ({self.experts_setting}):"
                                   " the experts' capacity depends on the tokens of each call; drop one of them")

    @property
    def layer_experts(self) -> list[int]:
        """Experts of each layer (1: a dense MLP), Megatron-DeepSpeed's rule: layer i (from 1) is an MoE layer
        when i is a multiple of --expert-interval, and takes the next value of --num-experts."""
        per_moe_layer = self.num_experts * (self.num_layers // self.expert_interval) if len(self.num_experts) == 1 \
            else self.num_experts
        return [per_moe_layer[(i - 1) // self.expert_interval] if i % self.expert_interval == 0 else 1
                for i in range(1, self.num_layers + 1)]

    @property
    def is_moe(self) -> bool:
        return any(n > 1 for n in self.layer_experts)

    @property
    def expert_parallel_size(self) -> int:
        """The ranks each MoE layer's experts are spread over (the run's layout, 1: every rank holds them all)."""
        return self.moe_expert_parallel_size

    @property
    def experts_setting(self) -> str:
        """--num-experts as the flag would give this model's (the messages that refuse an MoE model name it)."""
        return f"--num-experts {' '.join(map(str, self.num_experts))}"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """Dimensions of each head that rotary rotates (Megatron-DeepSpeed's int(head_dim x rotary_percent))."""
        return int(self.head_dim * self.rotary_percent)

    @property
    def kv_channels(self) -> int:
        """Width of the keys (and of the values): num_key_value_heads heads of head_dim."""
        return self.num_key_value_heads * self.head_dim

    @property
    def is_gpt2_shaped(self) -> bool:
        """GPT-2's architecture: LayerNorm, GELU, one K/V head per query head, tied output, biases."""
        return (self.normalization == "layernorm" and not self.swiglu and not self.squared_relu
                and not self.disable_bias_linear
                and self.num_key_value_heads == self.num_attention_heads
                and not self.untie_embeddings_and_output_weights)

    @property
    def learned_positions(self) -> int:
        """Rows of the learned position table: none with rotary positions."""
        return 0 if self.use_rotary_position_embeddings else self.max_position_embeddings

    def to_dict(self) -> dict:
        """The shape as plain values (what checkpoints store); the dtype is the run's, not the model's."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in RUN_FIELDS}

    @classmethod
    def from_dict(cls, values: dict, **overrides) -> "GPTConfig":
        return cls(**{**values, **overrides})


def parallel_shape_problems(config: GPTConfig, tensor_parallel_size: int, pipeline_parallel_size: int) -> list[str]:
    """Every way `config` cannot be split over the tensor- and pipeline-parallel ranks (none: it can).
    The one definition of these rules: the start-up support table and the model builders both use it."""
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    tp_flag, pp_flag = "--tensor-model-parallel-size", "--pipeline-model-parallel-size"
    splits = [("--num-attention-heads", config.num_attention_heads, tp_flag, tp),
              ("--hidden-size", config.hidden_size, tp_flag, tp),
              ("--ffn-hidden-size", config.ffn_hidden_size, tp_flag, tp),
              ("padded vocab size", config.padded_vocab_size, tp_flag, tp),
              ("--num-key-value-heads", config.num_key_value_heads, tp_flag, tp),
              ("--num-layers", config.num_layers, pp_flag, pp)]
    problems = [f"{flag} {value} is not divisible by {by_flag} {by}" for flag, value, by_flag, by in splits
                if value is not None and value % by]
    if config.sequence_parallel and config.seq_length % tp:
        problems.append(f"--seq-length {config.seq_length} is not divisible by {tp_flag} {tp} "
                        "(needed by --sequence-parallel)")
    return problems


def check_parallel_shape(config: GPTConfig, tensor_parallel_size: int, pipeline_parallel_size: int = 1) -> None:
    """What a model builder asks first: the shape is whole (the vocabulary known) and splits over the layout."""
    if config.padded_vocab_size is None:
        raise ModelConfigError("the padded vocabulary size is unknown: it comes from the tokenizer, read by "
                               "megatron/startup.py after the flags are parsed")
    problems = parallel_shape_problems(config, tensor_parallel_size, pipeline_parallel_size)
    if problems:
        raise ModelConfigError(problems[0])
