"""A transformer layer's recipe: the parts the GPTConfig picks for it, in Megatron-Core's "layer spec" spirit
(plain objects, no imports by name): its norm (LayerNorm or RMSNorm), its attention core, its MLP (GELU, SwiGLU or
squared ReLU; an MoE layer holds `experts` such MLPs). Each part owns what depends on its kind: the module it
builds, its parameters, its FLOPs, the activations its backward keeps, its checkpoint names (how tensor
parallelism splits them) and its Hugging Face names. The model (transformer.py), the accounting
(megatron/accounting/predict), the saved model's reader, the Hugging Face conversion and --finetune read the
recipe instead of asking the config which kind each part is.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    SequenceParallelLayerNorm,
    SequenceParallelRMSNorm,
    init_method_normal,
    scaled_init_method_normal,
)
from megatron.model.config import GPTConfig
from megatron.model.tiling import mlp_tiles, tiled_mlp

# (our name in a layer, Hugging Face's names in a layer, transposed?): several HF names are our tensor's rows cut
# into that many equal blocks (a gated MLP's input: HF's gate and up)
HFName = tuple[str, tuple[str, ...], bool]
# the Hugging Face families a layer can be written as, by its parts (megatron/inference/hf_gpt2.py, hf_llama.py)
HF_GPT2, HF_LLAMA = "gpt2", "llama"


@dataclass(frozen=True)
class Norm:
    """--normalization: LayerNorm (GPT-2's: weight and bias) or RMSNorm (Llama's: weight only)."""
    name: str
    module: type[nn.Module]
    bias: bool
    hf_family: str
    hf_names: tuple[HFName, ...]  # both norms of a layer

    @property
    def flags(self) -> tuple[str, ...]:
        return ("--normalization", self.name)

    def build(self, config: GPTConfig, tp_group) -> nn.Module:
        return self.module(config.hidden_size, eps=config.layernorm_epsilon, group=tp_group,
                           sequence_parallel=config.sequence_parallel, params_dtype=config.params_dtype)

    def vectors(self, hidden_size: int) -> list[int]:
        return [hidden_size, hidden_size] if self.bias else [hidden_size]

    def activation_bytes(self, element_bytes: int, on_cpu: bool) -> tuple[int, int]:
        """(bytes per element, bytes per token) one norm keeps: LayerNorm its input, its mean and 1/std (the input's
        dtype on CPU, fp32 on CUDA); RMSNorm on CPU (torch's unfused rms_norm computes in fp32) the input and the
        normalised input in fp32 and an fp32 1/rms, and on CUDA (a fused kernel; not measured here) its input and
        the fp32 1/rms."""
        if not self.bias:
            return (8 if on_cpu else element_bytes), 4
        return element_bytes, 2 * (element_bytes if on_cpu else 4)


LAYERNORM = Norm("layernorm", SequenceParallelLayerNorm, True, HF_GPT2, (
    ("input_layernorm.weight", ("ln_1.weight",), False), ("input_layernorm.bias", ("ln_1.bias",), False),
    ("post_attention_layernorm.weight", ("ln_2.weight",), False),
    ("post_attention_layernorm.bias", ("ln_2.bias",), False)))
RMSNORM = Norm("rmsnorm", SequenceParallelRMSNorm, False, HF_LLAMA, (
    ("input_layernorm.weight", ("input_layernorm.weight",), False),
    ("post_attention_layernorm.weight", ("post_attention_layernorm.weight",), False)))
NORMS = {norm.name: norm for norm in (LAYERNORM, RMSNORM)}


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2 (So et al. 2021, "Primer"; Nemotron-4), as Megatron-LM's --squared-relu computes it."""
    return torch.pow(F.relu(x), 2)


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


@dataclass(frozen=True)
class MLP:
    """The dense MLP's kind: h -> ffn -> activation -> h; a gated one's first matrix holds 2 ffn rows, gate and up,
    and computes activation(gate) x up (its TP shards are each [gate_r; up_r]: stride 2)."""
    name: str
    title: str  # as messages name it
    flags: tuple[str, ...]  # the flags that pick it (none: GPT-2's GELU, the default)
    activation: Callable[[torch.Tensor], torch.Tensor]
    gated: bool
    # [tokens, ffn] tensors its backward keeps per layer: GELU its input and output; the gated one gate and up (one
    # tensor), activation(gate) and the product; squared ReLU relu's output (pow's input too) and the square
    kept_ffn_tensors: int
    hf_family: str | None
    hf_names: tuple[HFName, ...]
    hf_activation: str | None = None  # config.json's name of the activation (Llama's hidden_act)
    hf_refusal: str | None = None  # why no Hugging Face architecture holds it

    def input_width(self, config: GPTConfig) -> int:
        """The first matrix's outputs: 2 ffn (gate and up) for a gated MLP, else ffn."""
        return 2 * config.ffn_hidden_size if self.gated else config.ffn_hidden_size

    def parameters(self, config: GPTConfig, tp: int = 1) -> tuple[list[int], list[int]]:
        """(matrices, biases) of one such MLP on a TP rank: in and out. An expert is one at TP=1."""
        h, f, f_in = config.hidden_size, config.ffn_hidden_size, self.input_width(config)
        return [h * f_in // tp, f * h // tp], ([f_in // tp, h] if not config.disable_bias_linear else [])

    def matmul_width(self, config: GPTConfig) -> int:
        """Multiply-adds per token per hidden feature: in (f_in outputs) and out (f inputs)."""
        return self.input_width(config) + config.ffn_hidden_size

    @property
    def strides(self) -> dict[str, int]:
        """{checkpoint name suffix: stride} of its tensors split in blocks over the TP ranks."""
        return {"dense_h_to_4h.weight": 2, "dense_h_to_4h.bias": 2} if self.gated else {}


_GPT2_MLP_NAMES: tuple[HFName, ...] = (
    ("mlp.dense_h_to_4h.weight", ("mlp.c_fc.weight",), True), ("mlp.dense_h_to_4h.bias", ("mlp.c_fc.bias",), False),
    ("mlp.dense_4h_to_h.weight", ("mlp.c_proj.weight",), True), ("mlp.dense_4h_to_h.bias", ("mlp.c_proj.bias",), False))
GELU = MLP("gelu", "GELU", (), _gelu, False, 2, HF_GPT2, _GPT2_MLP_NAMES, "gelu_new")
SWIGLU = MLP("swiglu", "SwiGLU", ("--swiglu",), F.silu, True, 4, HF_LLAMA, (
    ("mlp.dense_h_to_4h.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), False),
    ("mlp.dense_4h_to_h.weight", ("mlp.down_proj.weight",), False)), "silu")
SQUARED_RELU = MLP("squared_relu", "squared ReLU", ("--squared-relu",), squared_relu, False, 2, None, (),
                   hf_refusal="--squared-relu: no Hugging Face GPT-2 or Llama has a squared-ReLU MLP: no Hugging "
                              "Face export")


@dataclass(frozen=True)
class Attention:
    """The attention core (one kind): fused QKV (h -> h + 2 K/V width), the scores over s keys, out (h -> h)."""

    def parameters(self, config: GPTConfig, tp: int = 1) -> tuple[list[int], list[int]]:
        h, qkv = config.hidden_size, config.hidden_size + 2 * config.kv_channels
        return [h * qkv // tp, h * h // tp], ([qkv // tp, h] if not config.disable_bias_linear else [])

    def matmul_width(self, config: GPTConfig) -> int:
        """Multiply-adds per token per hidden feature of QKV and out."""
        return 2 * config.hidden_size + 2 * config.kv_channels

    def score_flops(self, config: GPTConfig, tokens: int) -> float:
        """Q K^T and softmax(.) V: s x s x h per sequence each, the whole square (module docstring of flops.py)."""
        return 4.0 * tokens * config.seq_length * config.hidden_size

    def hf_names(self, family: str) -> tuple[HFName, ...]:
        """The output projection's names (QKV's layout differs: hf_gpt2.py and hf_llama.py convert it)."""
        if family == HF_LLAMA:
            return (("self_attention.dense.weight", ("self_attn.o_proj.weight",), False),)
        return (("self_attention.dense.weight", ("attn.c_proj.weight",), True),
                ("self_attention.dense.bias", ("attn.c_proj.bias",), False))


ATTENTION = Attention()
# what each Hugging Face family's layer is made of, and so the flags a model needs to be written as one
FAMILY_PARTS = {HF_GPT2: (LAYERNORM, GELU), HF_LLAMA: (RMSNORM, SWIGLU)}
# the GPTConfig fields that pick a layer's parts, each a flag of its name (checkpoints record them)
ARCHITECTURE_FIELDS = (("normalization", "--normalization"), ("swiglu", "--swiglu"),
                       ("squared_relu", "--squared-relu"))


def norm_part(config: GPTConfig) -> Norm:
    return NORMS[config.normalization]


def mlp_part(config: GPTConfig | None = None, **flags: bool) -> MLP:
    """The dense MLP's kind the config (or its MLP flags as GPTConfig names them, e.g. swiglu=True) picks."""
    chosen = {name: flags.get(name, getattr(config, name, False)) for name in ("swiglu", "squared_relu")}
    return SWIGLU if chosen["swiglu"] else SQUARED_RELU if chosen["squared_relu"] else GELU


class ParallelMLP(nn.Module):
    """h -> f_in (column split) -> activation -> h (row split), of the kind the config's recipe picks; with
    --tiled-mlp-compute a tile of tokens at a time (megatron/model/tiling.py)."""

    def __init__(self, config: GPTConfig, tp_group, kind: MLP | None = None):
        super().__init__()
        self.kind = kind or mlp_part(config)
        self.config = config
        bias = not config.disable_bias_linear
        self.dense_h_to_4h = ColumnParallelLinear(
            config.hidden_size, self.kind.input_width(config), group=tp_group,
            init_method=init_method_normal(config.init_method_std), params_dtype=config.params_dtype,
            sequence_parallel=config.sequence_parallel, bias=bias, stride=2 if self.kind.gated else 1,
        )
        self.dense_4h_to_h = RowParallelLinear(
            config.ffn_hidden_size, config.hidden_size, group=tp_group,
            init_method=scaled_init_method_normal(config.init_method_std, config.num_layers),
            params_dtype=config.params_dtype, sequence_parallel=config.sequence_parallel, bias=bias,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tiles = mlp_tiles(self.config, x.shape[0], x.shape[1])
        return self.untiled(x) if tiles == 1 else tiled_mlp(self.untiled, self, x, tiles)

    def untiled(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dense_h_to_4h(x)
        if self.kind.gated:
            gate, up = y.chunk(2, dim=-1)
            return self.dense_4h_to_h(self.kind.activation(gate) * up)
        return self.dense_4h_to_h(self.kind.activation(y))


@dataclass(frozen=True)
class LayerRecipe:
    """One transformer layer: norm, attention, norm, MLP (an MoE layer of `experts` MLPs when experts > 1)."""
    config: GPTConfig
    norm: Norm
    attention: Attention
    mlp: MLP
    experts: int = 1

    def build_mlp(self, tp_group, expert_rank: int = 0) -> nn.Module:
        """The dense MLP, or DeepSpeed's MoE layer of such MLPs (imported here: it pulls in deepspeed, which the
        accounting, reading the same recipe, does without)."""
        if self.experts == 1:
            return ParallelMLP(self.config, tp_group, self.mlp)
        from megatron.model.moe import MoEMLP

        return MoEMLP(self.config, self.experts, lambda: ParallelMLP(self.config, None, self.mlp), expert_rank)

    def _moe_outside_experts(self) -> tuple[list[int], list[int]]:
        """What an MoE layer holds besides its experts, in module order: DeepSpeed's gate (h -> experts, no bias)
        and, for --mlp-type residual, the dense MLP beside the experts and the coefficient (h -> 2) that mixes the
        two."""
        h = self.config.hidden_size
        if self.config.mlp_type != "residual":
            return [h * self.experts], []
        matrices, biases = self.mlp.parameters(self.config)
        return [h * self.experts, *matrices, 2 * h], [*biases, 2]

    def parameters(self, tp: int = 1) -> tuple[list[int], list[int]]:
        """(matrices, vectors) one TP rank holds besides the experts, in module order: input norm, QKV, attention
        out, norm, MLP (an MoE layer's gate, and a residual MoE's dense MLP)."""
        h = self.config.hidden_size
        attention_matrices, attention_biases = self.attention.parameters(self.config, tp)
        mlp_matrices, mlp_biases = self.mlp.parameters(self.config, tp) if self.experts == 1 \
            else self._moe_outside_experts()
        norm = self.norm.vectors(h)
        return [*attention_matrices, *mlp_matrices], norm + attention_biases + norm + mlp_biases

    def expert_parameters(self, expert_parallel_size: int = 1) -> tuple[list[int], list[int]]:
        """(matrices, biases) of the experts one rank holds (experts / EP dense MLPs at TP=1); none when dense."""
        matrices, biases = self.mlp.parameters(self.config)
        local = self.experts // expert_parallel_size if self.experts > 1 else 0
        return matrices * local, biases * local

    def forward_flops(self, tokens: int) -> float:
        """Multiply-adds x 2 of the layer's forward over `tokens` tokens (megatron/accounting/predict/flops.py's
        layer_forward_flops says what is counted)."""
        config = self.config
        mlp = self.mlp.matmul_width(config)
        if self.experts > 1:
            mlp = config.topk * mlp + self.experts + ((mlp + 2) if config.mlp_type == "residual" else 0)
        matmuls = self.attention.matmul_width(config) + mlp  # per token, per input feature
        return 2.0 * tokens * config.hidden_size * matmuls + self.attention.score_flops(config, tokens)

    def hf_names(self, family: str) -> tuple[HFName, ...]:
        """The layer's names in `family`'s layer besides QKV (export_refusal first: the parts are the family's)."""
        return self.norm.hf_names + self.attention.hf_names(family) + self.mlp.hf_names


def layer_recipe(config: GPTConfig, experts: int = 1) -> LayerRecipe:
    """The one place that picks a layer's parts from the config."""
    return LayerRecipe(config, norm_part(config), ATTENTION, mlp_part(config), experts)


def layer_recipes(config: GPTConfig) -> list[LayerRecipe]:
    """Every layer's recipe, in order (config.layer_experts: which layers are MoE layers)."""
    return [layer_recipe(config, experts) for experts in config.layer_experts]


def hf_family(config: GPTConfig) -> str | None:
    """The Hugging Face family whose layer is made of this config's parts (None: no one family)."""
    recipe = layer_recipe(config)
    return next((family for family, parts in FAMILY_PARTS.items() if parts == (recipe.norm, recipe.mlp)), None)


def family_needs(config: GPTConfig, family: str) -> str | None:
    """The flag(s) a model lacks to have `family`'s parts (None: it has them), the norm's first."""
    recipe = layer_recipe(config)
    return next((" ".join(part.flags) for mine, part in zip((recipe.norm, recipe.mlp), FAMILY_PARTS[family])
                 if mine != part), None)


def export_refusal(config: GPTConfig) -> str | None:
    """Why no Hugging Face architecture can hold a part of this model (None: the families' own checks decide)."""
    return layer_recipe(config).mlp.hf_refusal


def to_hf_layer(ours: dict[str, torch.Tensor], src: str, dst: str, names: tuple[HFName, ...]) -> dict:
    """One layer's tensors by `names`, from our prefix `src` to HF's `dst`."""
    hf = {}
    for mine, theirs, transpose in names:
        for name, block in zip(theirs, ours[src + mine].chunk(len(theirs), dim=0)):
            hf[dst + name] = block.t() if transpose else block
    return hf


def from_hf_layer(hf: dict[str, torch.Tensor], src: str, dst: str, names: tuple[HFName, ...]) -> dict:
    """to_hf_layer's inverse: HF's prefix `src` to ours `dst`."""
    return {dst + mine: torch.cat([hf[src + name].t() if transpose else hf[src + name] for name in theirs])
            for mine, theirs, transpose in names}
