"""Every model preset (megatron/model/presets.py) against the published shape and parameter count it is named
after, with the parameters counted from the real module (on the meta device where it is too big for a CPU).

The published figures are written out here, not read from the code:
- GPT-3 paper (Brown et al. 2020, "Language Models are Few-Shot Learners", arXiv:2005.14165), Table 2.1;
- GPT-2 paper (Radford et al. 2019, "Language Models are Unsupervised Multitask Learners"), Table 2, with the
  head counts of OpenAI's released hparams.json files and the exact parameter counts of the released checkpoints
  (vocabulary 50257, 1024 positions, tied output layer), which Hugging Face's GPT2LMHeadModel also gives;
- ALCF's Megatron-DeepSpeed ALCF/model.sh for the 25B shape, which is in neither paper
  (github.com/saforem2/Megatron-DeepSpeed, ALCF/model.sh at 046b1f0 and 32184f5: 64 layers, hidden 5760, 64 heads);
- Llama 2 (Touvron et al. 2023, arXiv:2307.09288, Table 1 and the released params.json) and Llama 3 8B (Meta's
  released config.json): shapes, and the exact parameter counts of Hugging Face's LlamaForCausalLM of the released
  checkpoints (untied output layer, vocabularies 32000 and 128256).
"""
import pytest
import torch

from megatron.model import MODEL_PRESETS, GPTConfig, GPTModel
from megatron.accounting import count_parameters

GPT2_VOCAB = 50257  # GPT-2's BPE vocabulary, which GPT-3 kept

# GPT-3 Table 2.1 as printed: name -> (n_params, n_layers, d_model, n_heads, d_head). Two rows are inconsistent
# in print: XL's 24 heads of 128 are 3072, not its d_model 2048; 13B's 40 heads of 128 are 5120, not 5140.
GPT3_TABLE_2_1 = {
    "GPT-3 Small": (125e6, 12, 768, 12, 64),
    "GPT-3 Medium": (350e6, 24, 1024, 16, 64),
    "GPT-3 Large": (760e6, 24, 1536, 16, 96),
    "GPT-3 XL": (1.3e9, 24, 2048, 24, 128),
    "GPT-3 2.7B": (2.7e9, 32, 2560, 32, 80),
    "GPT-3 6.7B": (6.7e9, 32, 4096, 32, 128),
    "GPT-3 13B": (13.0e9, 40, 5140, 40, 128),
    "GPT-3 175B": (175.0e9, 96, 12288, 96, 128),
}
GPT3_CONTEXT = 2048

# GPT-2 Table 2 as printed: name -> (parameters, layers, d_model); then the released checkpoints' heads and
# exact parameter counts (the paper's column under-counts: the released 117M model has 124,439,808).
GPT2_TABLE_2 = {"117M": (117e6, 12, 768), "345M": (345e6, 24, 1024), "762M": (762e6, 36, 1280),
                "1542M": (1542e6, 48, 1600)}
GPT2_RELEASED = {"117M": (12, 124_439_808), "345M": (16, 354_823_168), "762M": (20, 774_030_080),
                 "1542M": (25, 1_557_611_200)}
GPT2_CONTEXT = 1024


def gpt3(name: str, heads: int | None = None, hidden: int | None = None) -> tuple:
    """(source, n_params, layers, hidden, heads, context) of a GPT-3 row; `heads` or `hidden` mend a
    misprinted field so that the shape is whole heads of the row's d_head."""
    n_params, layers, d_model, n_heads, d_head = GPT3_TABLE_2_1[name]
    hidden, heads = hidden or d_model, heads or n_heads
    assert hidden == heads * d_head, name
    return name, n_params, layers, hidden, heads, GPT3_CONTEXT


def gpt2(name: str) -> tuple:
    _, layers, d_model = GPT2_TABLE_2[name]
    heads, released = GPT2_RELEASED[name]
    return f"GPT-2 {name}", released, layers, d_model, heads, GPT2_CONTEXT


# preset -> what it is named after
PUBLISHED = {
    "125M": gpt3("GPT-3 Small"),
    "355M": gpt3("GPT-3 Medium"),
    "760M": gpt3("GPT-3 Large"),
    "774M": gpt2("762M"),
    "1.3B": gpt3("GPT-3 XL", heads=16),  # 2048 / d_head 128
    "1.5B": gpt2("1542M"),
    "2.7B": gpt3("GPT-3 2.7B"),
    "6.7B": gpt3("GPT-3 6.7B"),
    "13B": gpt3("GPT-3 13B", hidden=5120),  # 40 heads x d_head 128
    "25B": ("ALCF model.sh 25B", 25e9, 64, 5760, 64, GPT3_CONTEXT),
    "175B": gpt3("GPT-3 175B"),
}
# GPT-2's small and medium have the shapes of GPT-3 Small and Medium: their exact released counts too
GPT2_TWINS = {"125M": "117M", "355M": "345M", "774M": "762M", "1.5B": "1542M"}

# preset -> (source, exact parameters, layers, hidden, heads, K/V heads, FFN, vocabulary, rope theta)
LLAMA_PUBLISHED = {
    "llama2-7b": ("Llama 2 7B", 6_738_415_616, 32, 4096, 32, 32, 11008, 32000, 10000.0),
    "llama2-13b": ("Llama 2 13B", 13_015_864_320, 40, 5120, 40, 40, 13824, 32000, 10000.0),
    "llama3-8b": ("Llama 3 8B", 8_030_261_248, 32, 4096, 32, 8, 14336, 128256, 500000.0),
}


def build(name: str, vocab: int, positions: int, device: str = "meta") -> tuple[GPTConfig, int]:
    """The preset's config and the parameters of the real GPTModel built from it."""
    config = GPTConfig(**MODEL_PRESETS[name], seq_length=positions, max_position_embeddings=positions,
                       padded_vocab_size=vocab)
    torch.manual_seed(0)
    with torch.device(device):
        model = GPTModel(config)
    return config, sum(p.numel() for p in model.parameters())


# MoE preset -> (the dense preset whose shape it has, experts per MoE layer): Megatron-DeepSpeed's examples'
# 125M+MoE and 350M+MoE models (examples_deepspeed/MoE), with fewer experts, and a tiny one for CPU ranks
MOE_PRESETS = {"tiny-moe4": ("tiny", 4), "gpt-125m-moe8": ("125M", 8), "gpt-350m-moe16": ("355M", 16)}


def test_every_preset_but_tiny_is_named_after_a_published_model():
    assert sorted(MODEL_PRESETS) == sorted([*PUBLISHED, *LLAMA_PUBLISHED, "tiny", "llama-tiny", *MOE_PRESETS])


@pytest.mark.parametrize("name", MOE_PRESETS)
def test_moe_presets_are_their_dense_shape_with_experts_every_other_layer(name, data_prefix):
    from megatron.arguments import parse_args

    dense, experts = MOE_PRESETS[name]
    assert MODEL_PRESETS[name] == dict(MODEL_PRESETS[dense], num_experts=experts)
    args = parse_args(["--model-size", name, "--seq-length", "32", "--micro-batch-size", "1", "--train-iters", "1",
                       "--data-path", data_prefix], world_size=1)
    layers = MODEL_PRESETS[dense]["num_layers"]
    assert args.model.layer_experts == [1, experts] * (layers // 2)
    # --num-experts given wins over the preset's
    assert parse_args(["--model-size", name, "--seq-length", "32", "--micro-batch-size", "1", "--train-iters", "1",
                       "--data-path", data_prefix, "--num-experts", "2"], world_size=1).model.layer_experts[1] == 2


@pytest.mark.parametrize("name", PUBLISHED)
def test_preset_shape_is_the_published_shape(name):
    source, _, layers, hidden, heads, _ = PUBLISHED[name]
    assert MODEL_PRESETS[name] == dict(num_layers=layers, hidden_size=hidden, num_attention_heads=heads), source


@pytest.mark.parametrize("name", PUBLISHED)
def test_preset_parameter_count_is_the_published_count(name):
    """The real module's parameters with GPT-2's vocabulary and the source's context, within 2% of the published
    count (the papers print 2-3 digits: GPT-3 Medium is 355.9M by this count, printed 350M)."""
    source, n_params, _, _, _, context = PUBLISHED[name]
    config, counted = build(name, GPT2_VOCAB, context, device="cpu" if name == "125M" else "meta")
    assert counted == count_parameters(config)
    # ALCF's "25B" is a name, not a published count (64 x 5760 holds 25.8B by this count)
    assert counted == pytest.approx(n_params, rel=0.05 if source.startswith("ALCF") else 0.02), (source, counted)


@pytest.mark.parametrize("name", GPT2_TWINS)
def test_gpt2_shaped_presets_have_the_released_checkpoints_exact_counts(name):
    _, counted = build(name, GPT2_VOCAB, GPT2_CONTEXT)
    _, released = GPT2_RELEASED[GPT2_TWINS[name]]
    assert counted == released


def test_gpt2_released_counts_are_hugging_faces():
    """The literal counts above, against Hugging Face's GPT2LMHeadModel built with the released hparams."""
    transformers = pytest.importorskip("transformers")
    for name, (_, layers, d_model) in GPT2_TABLE_2.items():
        heads, released = GPT2_RELEASED[name]
        config = transformers.GPT2Config(vocab_size=GPT2_VOCAB, n_positions=GPT2_CONTEXT, n_embd=d_model,
                                         n_layer=layers, n_head=heads)
        with torch.device("meta"):
            model = transformers.GPT2LMHeadModel(config)
        assert sum(p.numel() for p in model.parameters()) == released, name


@pytest.mark.parametrize("name", LLAMA_PUBLISHED)
def test_llama_preset_is_the_released_shape_and_exact_count(name):
    """Llama's shapes, built as the real module on the meta device with the released vocabulary: the exact count of
    the released checkpoints (what LlamaForCausalLM counts), and the preset's vocabulary the released one."""
    from megatron.model.presets import PRESET_VOCABULARY

    source, n_params, layers, hidden, heads, kv_heads, ffn, vocab, theta = LLAMA_PUBLISHED[name]
    config, counted = build(name, vocab, 4096)
    assert (config.num_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.ffn_hidden_size, config.rope_theta) == (layers, hidden, heads, kv_heads, ffn, theta), source
    assert config.swiglu and config.normalization == "rmsnorm" and config.untie_embeddings_and_output_weights
    assert PRESET_VOCABULARY[name] == vocab
    assert counted == count_parameters(config) == n_params, source


def test_tiny_counted_by_hand():
    """tiny (2 layers, hidden 128) with a 512-token vocabulary and 64 positions, built on the CPU. Per layer:
    QKV 128 x 384 + 384, projection 128 x 128 + 128, MLP 128 x 512 + 512 and 512 x 128 + 128, two LayerNorms
    2 x (128 + 128); then word and position embeddings and the final LayerNorm."""
    layer = (128 * 384 + 384) + (128 * 128 + 128) + (128 * 512 + 512) + (512 * 128 + 128) + 2 * (128 + 128)
    assert layer == 198_272
    config, counted = build("tiny", 512, 64, device="cpu")
    assert counted == 2 * layer + 512 * 128 + 64 * 128 + 2 * 128 == 470_528
    assert count_parameters(config) == counted


def test_preset_fields_lets_a_given_flag_win_and_leaves_the_preset_where_none_is_given():
    """The one rule pretrain_gpt.py and tools/zero_plan.py build a model by: a flag given (not None, not False)
    wins over the preset; --num-experts' one value becomes a list; the shape comes from one or the other."""
    from megatron.model.presets import PresetError, preset_fields

    fields = preset_fields("llama3-8b", {"num_layers": 4, "hidden_size": None, "rope_theta": 10000.0,
                                         "untie_embeddings_and_output_weights": False})
    assert fields == dict(MODEL_PRESETS["llama3-8b"], num_layers=4, rope_theta=10000.0)
    assert preset_fields("gpt-125m-moe8", {})["num_experts"] == [8]
    assert preset_fields("gpt-125m-moe8", {"num_experts": [4, 8, 4, 8, 4, 8]})["num_experts"] == [4, 8, 4, 8, 4, 8]
    assert preset_fields(None, {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4}) == dict(
        num_layers=2, hidden_size=64, num_attention_heads=4)
    with pytest.raises(PresetError, match=r"^--model-size '2B' is not a preset \(choose from tiny, 125M, "):
        preset_fields("2B", {})
    with pytest.raises(PresetError, match=r"^--hidden-size is required \(or give --model-size\)$"):
        preset_fields(None, {"num_layers": 2})
