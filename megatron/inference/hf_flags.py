"""The pretrain_gpt.py flags that give a Hugging Face GPT-2 or Llama folder's model, read through transformers' own
config class (so every form of config.json that transformers reads is read as it reads it: a transformers 4
top-level rope_theta as transformers 5's rope_parameters). tools/hf_to_checkpoint.py prints them; the launch
planner (which imports no torch, and transformers' config class imports it) runs

    python -m megatron.inference.hf_flags FOLDER [MODEL_SIZE]

for INIT_HF and reads one JSON line: the flags, the positions, the MODEL_SIZE preset of the same architecture
(or null), and how the folder differs from MODEL_SIZE's preset where one was given; or one `error:` line, exit 1.
"""
from __future__ import annotations

import json
import sys

from megatron.model.config import GPTConfig
from megatron.model.recipe import ARCHITECTURE_FIELDS, HF_LLAMA, hf_family, layer_recipe

# the fields that make a preset's architecture (rope theta and the norms' epsilon are flags beside it), with their
# names in a Llama's and a GPT-2's config.json; the family's fields (the layer recipe's norm and MLP, rotary, no
# biases) are its model_type, and MoE presets have experts no Hugging Face GPT-2 or Llama has
SHAPE = {"num_layers": ("num_hidden_layers", "n_layer"), "hidden_size": ("hidden_size", "n_embd"),
         "num_attention_heads": ("num_attention_heads", "n_head"),
         "num_key_value_heads": ("num_key_value_heads", None), "ffn_hidden_size": ("intermediate_size", "n_inner"),
         "untie_embeddings_and_output_weights": ("tie_word_embeddings", "tie_word_embeddings"),
         "num_experts": ("experts", "experts")}
FAMILY = (*(key for key, _ in ARCHITECTURE_FIELDS), "use_rotary_position_embeddings", "disable_bias_linear")


def number(value: float) -> str:
    """A float as a flag's value: short where that is exact (1e-05, 500000), else every digit."""
    return f"{value:g}" if float(f"{value:g}") == value else repr(value)


def model_flags(config: GPTConfig) -> list[str]:
    """The flags of `config`'s shape: GPT-2's (layers, hidden, heads, FFN where not 4h) or a Llama's (those, and
    what makes it a Llama), the norms' epsilon and rope theta included: their defaults need not be the model's."""
    flags = ["--num-layers", str(config.num_layers), "--hidden-size", str(config.hidden_size),
             "--num-attention-heads", str(config.num_attention_heads)]
    if hf_family(config) == HF_LLAMA:
        recipe = layer_recipe(config)
        flags += ["--num-key-value-heads", str(config.num_key_value_heads), "--ffn-hidden-size",
                  str(config.ffn_hidden_size), "--rope-theta", number(config.rope_theta), *recipe.norm.flags,
                  *recipe.mlp.flags, "--use-rotary-position-embeddings", "--disable-bias-linear"]
        flags += ["--untie-embeddings-and-output-weights"] * config.untie_embeddings_and_output_weights
    elif config.ffn_hidden_size != 4 * config.hidden_size:
        flags += ["--ffn-hidden-size", str(config.ffn_hidden_size)]
    return flags + ["--layernorm-epsilon", number(config.layernorm_epsilon)]


def read_hf_config(path: str, padded_vocab_size: int | None = None):
    """(transformers' config, our GPTConfig) of a GPT-2 or Llama folder; ValueError naming what does not fit."""
    import transformers

    from megatron.inference import hf_gpt2, hf_llama

    try:
        hf_config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(f"cannot read its config.json ({str(err).splitlines()[0]})") from None
    mapping = {"llama": hf_llama, "gpt2": hf_gpt2}.get(hf_config.model_type)
    if mapping is None:
        raise ValueError(f"model_type {hf_config.model_type!r}: expected a GPT-2 ('gpt2') or Llama ('llama') model")
    return hf_config, mapping.from_hf_config(hf_config, padded_vocab_size or hf_config.vocab_size)


def preset_differences(config: GPTConfig, preset: dict) -> list[str]:
    """How `config`'s architecture differs from a MODEL_PRESETS entry's, in config.json's names (none: the same)."""
    values = {key: [value] if key == "num_experts" else value for key, value in preset.items()
              if key in SHAPE or key in FAMILY}
    theirs = GPTConfig(**values, seq_length=1, max_position_embeddings=1, padded_vocab_size=None)
    if any(getattr(config, key) != getattr(theirs, key) for key in FAMILY):
        return [f"model_type {hf_family(config)!r} (the preset's: {hf_family(theirs)!r})"]
    differences = []
    for key, names in SHAPE.items():
        mine, other = getattr(config, key), getattr(theirs, key)
        if key == "untie_embeddings_and_output_weights":
            mine, other = not mine, not other  # config.json says tie_word_embeddings
        name = names[0 if hf_family(config) == HF_LLAMA else 1]
        derived = name == "n_inner" and mine == 4 * config.hidden_size  # GPT-2's n_inner null: 4 x n_embd
        if mine != other and name is not None and not derived:
            differences.append(f"{name} {mine} (the preset's: {other})")
    return differences


def main(argv: list[str]) -> int:
    from megatron.model.presets import MODEL_PRESETS

    path, model_size = argv[0], (argv[1:] or [None])[0]
    try:
        config = read_hf_config(path)[1]
    except ValueError as err:
        print(f"error: INIT_HF={path}: {err}", file=sys.stderr)
        return 1
    preset = next((name for name, shape in MODEL_PRESETS.items() if not preset_differences(config, shape)), None)
    differs = preset_differences(config, MODEL_PRESETS[model_size]) if model_size in MODEL_PRESETS else []
    print(json.dumps(dict(flags=model_flags(config), positions=config.max_position_embeddings, preset=preset,
                          differs=differs)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
