"""The layer recipe (megatron/model/recipe.py) against the model built from it: for every preset, a Llama, an MoE
variant and the squared-ReLU MLP, the parameters each layer's parts count are the real module's (built on the meta
device), and where a direct count exists the FLOPs (torch's FlopCounterMode) and the activations the backward keeps
(saved_activation_bytes). Squared ReLU (Megatron-LM's --squared-relu) trains through pretrain_gpt.py, and its
export to Hugging Face is refused in one line naming the flag."""
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from conftest import PARALLEL_ITERS, parallel_pretrain, tool_in_process
from megatron.accounting import TrainingSetup, activation_bytes, count_parameters, model_flops_per_iteration
from megatron.arguments import ConfigError, parse_args
from megatron.core.tensor_parallel import model_parallel_tracker
from megatron.model import MODEL_PRESETS, GPTConfig, GPTModel
from megatron.model.config import ModelConfigError
from megatron.model.presets import PRESET_SEQ_LENGTH, PRESET_VOCABULARY
from megatron.model.recipe import (GELU, LAYERNORM, RMSNORM, SQUARED_RELU, SWIGLU, export_refusal, layer_recipe,
                                   layer_recipes, squared_relu)
from megatron.model.transformer import ParallelTransformerLayer
from test_flops import counted_flops
from test_memory import _measured_activations
from test_parallel_training import losses

# the presets and the variants the recipe picks other parts for: squared ReLU (GPT-2's shape, then Llama's), an MoE
# Llama, a residual top-2 MoE
VARIANTS = {
    **{name: dict(shape) for name, shape in MODEL_PRESETS.items()},
    "tiny-squared-relu": dict(MODEL_PRESETS["tiny"], squared_relu=True),
    "125M-squared-relu": dict(MODEL_PRESETS["125M"], squared_relu=True),
    "llama-tiny-squared-relu": dict(MODEL_PRESETS["llama-tiny"], swiglu=False, squared_relu=True),
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
              for name in ("tiny", "llama-tiny", "tiny-squared-relu", "llama-tiny-squared-relu")}
    assert picked == {"tiny": (LAYERNORM, GELU), "llama-tiny": (RMSNORM, SWIGLU),
                      "tiny-squared-relu": (LAYERNORM, SQUARED_RELU),
                      "llama-tiny-squared-relu": (RMSNORM, SQUARED_RELU)}
    assert [recipe.experts for recipe in layer_recipes(variant("tiny-moe4"))] == [1, 4]


def test_squared_relu_is_megatrons():
    """Megatron-DeepSpeed's transformer.py (ParallelMLP, args.squared_relu): torch.pow(F.relu(x), 2)."""
    x = torch.tensor([-2.0, -0.5, 0.0, 0.5, 3.0])
    assert torch.equal(squared_relu(x), torch.tensor([0.0, 0.0, 0.0, 0.25, 9.0]))


@pytest.mark.parametrize("name", ["tiny", "llama-tiny", "tiny-squared-relu", "llama-tiny-squared-relu"])
def test_one_layers_forward_flops_are_its_recipes(name):
    """FlopCounterMode around one layer's forward (the attention products as two bmm under SDPA's math kernel)."""
    config = variant(name, seq_length=32)
    layer = ParallelTransformerLayer(config, None, model_parallel_tracker(1, 0))
    counter = FlopCounterMode(display=False)
    with sdpa_kernel(SDPBackend.MATH), counter:
        layer(torch.randn(2, 32, config.hidden_size))
    assert counter.get_total_flops() == layer_recipe(config).forward_flops(2 * 32)


def test_a_squared_relu_model_s_flops_are_torch_s_count():
    config = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                       max_position_embeddings=32, padded_vocab_size=256, squared_relu=True)
    assert model_flops_per_iteration(config, 2) == pytest.approx(counted_flops(config, 2), rel=1e-9)
    h, f, s, tokens = 64, 256, 32, 2 * 32  # written out: GELU's matrices, 3 passes of the forward
    layer = 2 * tokens * (3 * h * h + h * h + 2 * h * f) + 4 * tokens * s * h
    assert model_flops_per_iteration(config, 2) == 3 * (2 * layer + 2 * tokens * h * 256)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_squared_relu_activations_are_the_prediction(dropout):
    """relu's output (pow's input) and the square are what the MLP keeps: GELU's two ffn tensors, within 1%."""
    config = GPTConfig(num_layers=2, hidden_size=128, num_attention_heads=4, seq_length=64,
                       max_position_embeddings=64, padded_vocab_size=1024, hidden_dropout=dropout,
                       attention_dropout=dropout, squared_relu=True)
    predicted = activation_bytes(config, TrainingSetup(world_size=1, micro_batch_size=4, device="cpu"))
    assert _measured_activations(config) == pytest.approx(predicted, rel=0.01)


def test_squared_relu_and_swiglu_together_are_refused(data_prefix):
    with pytest.raises(ModelConfigError, match=r"^--squared-relu and --swiglu each pick the MLP's activation"):
        GPTConfig.from_dict(variant("tiny").to_dict(), swiglu=True, squared_relu=True)
    argv = ["--model-size", "tiny", "--seq-length", "32", "--micro-batch-size", "1", "--train-iters", "1",
            "--data-path", data_prefix]
    assert parse_args([*argv, "--squared-relu"], world_size=1).model.squared_relu
    with pytest.raises((ConfigError, ModelConfigError), match="--squared-relu and --swiglu"):
        parse_args([*argv, "--squared-relu", "--swiglu"], world_size=1)


def test_a_squared_relu_model_has_no_hugging_face_export():
    assert export_refusal(variant("tiny-squared-relu")) == (
        "--squared-relu: no Hugging Face GPT-2 or Llama has a squared-ReLU MLP: no Hugging Face export")
    assert export_refusal(variant("tiny")) is None and export_refusal(variant("llama-tiny")) is None


@pytest.mark.slow
def test_squared_relu_trains_and_its_checkpoint_is_refused_by_the_export(dolly_data_dir, tmp_path, capsys):
    """pretrain_gpt.py --squared-relu on a CPU rank: the loss falls; tools/checkpoint_to_hf.py refuses the checkpoint
    in one line naming the flag, exit 1, and writes nothing."""
    run = parallel_pretrain(dolly_data_dir, 1, "--squared-relu", "--zero-stage", "0", "--save", str(tmp_path / "ck"),
                            "--save-interval", str(PARALLEL_ITERS))
    trained = losses(run.stdout)
    assert len(trained) == PARALLEL_ITERS + 1 and trained[PARALLEL_ITERS - 1] < trained[0] - 0.2
    code, out, err = tool_in_process(capsys, "checkpoint_to_hf.py", "--load", tmp_path / "ck", "--output",
                                     tmp_path / "hf")
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and err.rstrip().endswith(
        "--squared-relu: no Hugging Face GPT-2 or Llama has a squared-ReLU MLP: no Hugging Face export"), err
    assert not (tmp_path / "hf").exists()


def test_a_squared_relu_checkpoint_resumes_only_with_the_flag(tmp_path):
    """The marker records the MLP's activation (the recipe's architecture fields): a squared-ReLU checkpoint resumed
    as GELU (same shapes, other weights' meaning) is refused in one line naming the flag, and resumes with it."""
    from megatron.checkpointing.resume_check import check_layout
    from test_resume_model import NEW_FOLDER, TAG, args_of, refusal, saved_by

    saved_by(tmp_path, args_of(tmp_path, "--squared-relu"))
    assert refusal(tmp_path) == (
        "it was saved from a model with --squared-relu, this run's has no --squared-relu: resume it with "
        f"--squared-relu, or {NEW_FOLDER}")
    check_layout(args_of(tmp_path, "--squared-relu"), TAG)
