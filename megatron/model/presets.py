"""Named model shapes: the one table of them (pretrain_gpt.py's --model-size, ALCF/models.sh's
MODEL_SIZE_KEY, tools/zero_plan.py and the Hugging Face conversion all read it).

`python megatron/model/presets.py NAME` prints "layers hidden heads" for shell scripts (no torch import); an MoE
preset also gives num_experts (--num-experts' default with it). `preset_fields` is the one rule by which a preset
and the flags given make GPTConfig's fields (pretrain_gpt.py's flags and tools/zero_plan.py's both use it).
"""
import sys

from megatron.errors import ZeroLabError

# (num_layers, hidden_size, num_attention_heads), and for Llama shapes the architecture's GPTConfig fields too
# (their flags' defaults under --model-size; docs/model.md). GPT-2: 125M/355M/774M/1.5B (the 1.5B is GPT-2 XL,
# 25 heads of 64). GPT-3 paper family (Table 2.1): 760M, 1.3B, 2.7B, 6.7B, 13B (40 heads of 128), 175B; 25B is
# the ALCF Megatron-DeepSpeed scripts' (ALCF/model.sh: 64 layers, hidden 5760, 64 heads). "tiny" is for CPU runs.
# Llama 2 (Touvron et al. 2023, "Llama 2", and Meta's released params.json / Hugging Face config.json: 7B 32 x 4096,
# 32 heads, FFN 11008; 13B 40 x 5120, 40 heads, FFN 13824; vocabulary 32000) and Llama 3 8B (Meta's config.json:
# 32 x 4096, 32 query heads over 8 K/V heads, FFN 14336, rope theta 500000, vocabulary 128256). "llama-tiny" is
# for CPU runs: grouped-query attention (4 heads over 2 K/V heads) so that TP=2 splits K/V heads too.
# GPTConfig's Llama fields beyond the shape, each the flag of its name (docs/model.md); a preset may set them
LLAMA_FLAGS = ("num_key_value_heads", "ffn_hidden_size", "swiglu", "normalization",
               "untie_embeddings_and_output_weights", "disable_bias_linear", "rope_theta")
SHAPE_FLAGS = ("num_layers", "hidden_size", "num_attention_heads")  # every model needs these, from a preset or flags
LLAMA = dict(use_rotary_position_embeddings=True, normalization="rmsnorm", swiglu=True,
         untie_embeddings_and_output_weights=True, disable_bias_linear=True)
MODEL_PRESETS: dict[str, dict[str, int | str | bool | float]] = {
    "tiny": dict(num_layers=2, hidden_size=128, num_attention_heads=4),
    "125M": dict(num_layers=12, hidden_size=768, num_attention_heads=12),
    "355M": dict(num_layers=24, hidden_size=1024, num_attention_heads=16),
    "760M": dict(num_layers=24, hidden_size=1536, num_attention_heads=16),
    "774M": dict(num_layers=36, hidden_size=1280, num_attention_heads=20),
    "1.3B": dict(num_layers=24, hidden_size=2048, num_attention_heads=16),
    "1.5B": dict(num_layers=48, hidden_size=1600, num_attention_heads=25),
    "2.7B": dict(num_layers=32, hidden_size=2560, num_attention_heads=32),
    "6.7B": dict(num_layers=32, hidden_size=4096, num_attention_heads=32),
    "13B": dict(num_layers=40, hidden_size=5120, num_attention_heads=40),
    "25B": dict(num_layers=64, hidden_size=5760, num_attention_heads=64),
    "175B": dict(num_layers=96, hidden_size=12288, num_attention_heads=96),
    "llama-tiny": dict(num_layers=2, hidden_size=128, num_attention_heads=4, **LLAMA, num_key_value_heads=2,
                       ffn_hidden_size=352),
    "llama2-7b": dict(num_layers=32, hidden_size=4096, num_attention_heads=32, **LLAMA, ffn_hidden_size=11008),
    "llama2-13b": dict(num_layers=40, hidden_size=5120, num_attention_heads=40, **LLAMA, ffn_hidden_size=13824),
    "llama3-8b": dict(num_layers=32, hidden_size=4096, num_attention_heads=32, **LLAMA, num_key_value_heads=8,
                      ffn_hidden_size=14336, rope_theta=500000.0),
}
# the vocabulary (before padding) of the tokenizer a preset was published with, where it is not GPT-2's 50257
PRESET_VOCABULARY = {"llama2-7b": 32000, "llama2-13b": 32000, "llama3-8b": 128256}
# the context length a preset was published with, where it is not GPT-3's 2048 (Llama 2: 4096, Touvron et al. 2023;
# Llama 3 8B: 8192, Meta's config.json max_position_embeddings): tools/zero_plan.py's --seq-length default
PRESET_SEQ_LENGTH = {"llama2-7b": 4096, "llama2-13b": 4096, "llama3-8b": 8192}
# Mixture of experts (docs/moe.md), named as Megatron-DeepSpeed's examples_deepspeed/MoE name theirs (a dense
# shape + MoE-<experts>): the dense preset's shape with num_experts experts in every other layer (--num-experts).
MODEL_PRESETS |= {
    "tiny-moe4": dict(MODEL_PRESETS["tiny"], num_experts=4),
    "gpt-125m-moe8": dict(MODEL_PRESETS["125M"], num_experts=8),
    "gpt-350m-moe16": dict(MODEL_PRESETS["355M"], num_experts=16),
}


class PresetError(ZeroLabError, ValueError):
    """An unknown --model-size, or a shape flag missing without one; the message names the flag."""


def preset_fields(model_size: str | None, given: dict) -> dict:
    """GPTConfig's fields from a --model-size preset (None: none) and the flags `given` ({field: value}): a flag
    given (not None, not False) wins over the preset's value, as in Megatron's model scripts; --num-experts' one
    value is a list of one. The shape (SHAPE_FLAGS) must come from one or the other."""
    if model_size is not None and model_size not in MODEL_PRESETS:
        raise PresetError(f"--model-size {model_size!r} is not a preset (choose from {', '.join(MODEL_PRESETS)})")
    fields = dict(MODEL_PRESETS.get(model_size, {}))
    fields.update({name: value for name, value in given.items() if value is not None and value is not False})
    for name in SHAPE_FLAGS:
        if fields.get(name) is None:
            raise PresetError(f"--{name.replace('_', '-')} is required (or give --model-size)")
    if isinstance(fields.get("num_experts"), int):
        fields["num_experts"] = [fields["num_experts"]]
    return fields


def preset_experts(model_size: str | None) -> str:
    """A preset's experts per MoE layer as the launch's variable gives them ("1": a dense preset, or none)."""
    return str(MODEL_PRESETS.get(model_size or "", {}).get("num_experts", 1))


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in MODEL_PRESETS:
        given = argv[0] if argv else "nothing"
        print(f"error: model preset {given!r} is unknown (choose from {', '.join(MODEL_PRESETS)})", file=sys.stderr)
        return 1
    shape = MODEL_PRESETS[argv[0]]
    print(shape["num_layers"], shape["hidden_size"], shape["num_attention_heads"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
