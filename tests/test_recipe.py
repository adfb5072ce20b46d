"""The layer recipe (megatron/model/recipe.py) against the model built from it: for every preset, a Llama and MoE
variants, the parameters each layer's parts count are the real module's (built on the meta device), and where a
direct count exists the FLOPs (torch's FlopCounterMode)."""
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from megatron.accounting import count_parameters
from megatron.core.tensor_parallel import model_parallel_tracker
from megatron.model import MODEL_PRESETS, GPTConfig, GPTModel
from megatron.model.presets import PRESET_SEQ_LENGTH, PRESET_VOCABULARY
from megatron.model.recipe import GELU, LAYERNORM, RMSNORM, SWIGLU, layer_recipe, layer_recipes
from megatron.model.transformer import ParallelTransformerLayer

# the presets and the variants the recipe picks other parts for: an MoE Llama, a residual top-2 MoE
VARIANTS = {
    **{name: dict(shape) for name, shape in MODEL_PRESETS.items()},
    "llama-tiny-moe4": dict(MODEL_PRESETS["llama-tiny"], num_experts=4),
    "tiny-moe4-residual-top2": dict(MODEL_PRESETS["tiny"], num_experts=4, mlp_type="residual", topk=2),
}


def variant(name: str, seq_length: int | None = None) -> GPTConfig:
    shape = dict(VARIANTS[name])
    experts = shape.pop("num_experts", 1)
    seq = seq_length or PRESET_SEQ_LENGTH.get(name, 2048)
    return GPTConfig(**shape, num_experts=[experts], seq_length=seq, max_position_embeddings=seq,
                     padded_vocab_size=PRESET_VOCABULARY.get(name, 50304))


def is_expert(name: str) -> bool:
    return ".deepspeed_experts." in name


@pytest.mark.parametrize("name", VARIANTS)
def test_every_layers_parts_count_the_parameters_of_the_model_built_on_the_meta_device(name):
    config = variant(name)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPTModel(config)
    assert sum(p.numel() for p in model.parameters()) == count_parameters(config)
    for layer, recipe in zip(model.layers, layer_recipes(config), strict=True):
        own = [p.numel() for n, p in layer.named_parameters() if not is_expert(n)]
        experts = [p.numel() for n, p in layer.named_parameters() if is_expert(n)]
        matrices, vectors = recipe.parameters()
        assert sorted(own) == sorted(matrices + vectors)
        assert sorted(experts) == sorted(sum(recipe.expert_parameters(), []))
        assert type(layer.input_layernorm) is recipe.norm.module is type(layer.post_attention_layernorm)
        if recipe.experts == 1:
            assert layer.mlp.kind is recipe.mlp


def test_the_recipe_picks_each_part_from_the_flags():
    picked = {name: (layer_recipe(variant(name)).norm, layer_recipe(variant(name)).mlp)
              for name in ("tiny", "llama-tiny")}
    assert picked == {"tiny": (LAYERNORM, GELU), "llama-tiny": (RMSNORM, SWIGLU)}
    assert [recipe.experts for recipe in layer_recipes(variant("tiny-moe4"))] == [1, 4]


@pytest.mark.parametrize("name", ["tiny", "llama-tiny"])
def test_one_layers_forward_flops_are_its_recipes(name):
    """FlopCounterMode around one layer's forward (the attention products as two bmm under SDPA's math kernel)."""
    config = variant(name, seq_length=32)
    layer = ParallelTransformerLayer(config, None, model_parallel_tracker(1, 0))
    counter = FlopCounterMode(display=False)
    with sdpa_kernel(SDPBackend.MATH), counter:
        layer(torch.randn(2, 32, config.hidden_size))
    assert counter.get_total_flops() == layer_recipe(config).forward_flops(2 * 32)
