"""GPTConfig: the model's shape and regularisation, validated with Megatron flag names."""
from __future__ import annotations

from dataclasses import dataclass

import torch

# GPT-2 family sizes (num_layers, hidden_size, num_attention_heads); "tiny" is for CPU runs.
MODEL_PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(num_layers=2, hidden_size=128, num_attention_heads=4),
    "125M": dict(num_layers=12, hidden_size=768, num_attention_heads=12),
    "355M": dict(num_layers=24, hidden_size=1024, num_attention_heads=16),
    "774M": dict(num_layers=36, hidden_size=1280, num_attention_heads=20),
    "1.5B": dict(num_layers=48, hidden_size=1600, num_attention_heads=25),
}

_PARAMS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class ModelConfigError(ValueError):
    """An inconsistent model shape; the message names the Megatron flag."""


@dataclass
class GPTConfig:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    max_position_embeddings: int
    padded_vocab_size: int
    ffn_hidden_size: int | None = None
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    layernorm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    checkpoint_activations: bool = False
    params_dtype: torch.dtype = torch.float32
    # Megatron's --sequence-parallel: LayerNorm/dropout regions split along the sequence over the TP group.
    sequence_parallel: bool = False

    def __post_init__(self):
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        for flag, value in (
            ("--num-layers", self.num_layers),
            ("--hidden-size", self.hidden_size),
            ("--num-attention-heads", self.num_attention_heads),
            ("--seq-length", self.seq_length),
            ("--max-position-embeddings", self.max_position_embeddings),
            ("padded vocab size", self.padded_vocab_size),
            ("--ffn-hidden-size", self.ffn_hidden_size),
        ):
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
        if self.params_dtype not in _PARAMS_DTYPES:
            raise ModelConfigError(f"params dtype must be one of float32, bfloat16, float16, got {self.params_dtype}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads
