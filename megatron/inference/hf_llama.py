"""Weight and config mapping between our Llama-shaped GPTModel and Hugging Face's LlamaForCausalLM.

Two layout differences matter. Our fused query_key_value is laid out per K/V group as
[kv_head, (q x heads / kv_heads, k, v), head_dim] (a tensor-parallel column split hands every rank whole
groups); HF keeps q_proj, k_proj and v_proj apart, query head h served by K/V head h // (heads / kv_heads), the
group our layout keeps together. Our dense_h_to_4h is the gated MLP's [gate; up] (reassembled from the TP ranks'
[gate_r; up_r] by megatron.saved_model.layouts), HF's gate_proj and up_proj (the layer's names besides QKV are its
recipe's, megatron/model/recipe.py). Both apply rotary as rotate_half over
the whole head with the angles position x theta^(-2i / head_dim) repeated over the two halves
(megatron/model/rotary.py), so q and k rows need no permutation.
"""
from __future__ import annotations

import torch

from megatron.model import GPTConfig
from megatron.model.presets import LLAMA
from megatron.model.recipe import FAMILY_PARTS, HF_LLAMA, family_needs, from_hf_layer, layer_recipe, to_hf_layer

def llama_refusal(config: GPTConfig) -> str | None:
    """Why LlamaForCausalLM cannot hold this model, or None."""
    parts = family_needs(config, HF_LLAMA)  # --normalization rmsnorm, the gated SiLU MLP's flag
    for wrong, flag in ((parts is not None, parts),
                        (not config.use_rotary_position_embeddings, "--use-rotary-position-embeddings"),
                        (not config.disable_bias_linear, "--disable-bias-linear"),
                        (config.rotary_percent != 1.0, "--rotary-percent 1.0")):
        if wrong:
            return f"Hugging Face Llama needs {flag}"
    return None


def to_hf_config(config: GPTConfig, vocab_size: int, bos: int | None, eod: int | None):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=config.hidden_size, intermediate_size=config.ffn_hidden_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim, hidden_act="silu",
        max_position_embeddings=config.max_position_embeddings, initializer_range=config.init_method_std,
        rms_norm_eps=config.layernorm_epsilon,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        attention_bias=False, mlp_bias=False, attention_dropout=config.attention_dropout,
        tie_word_embeddings=not config.untie_embeddings_and_output_weights, bos_token_id=bos, eos_token_id=eod,
        architectures=["LlamaForCausalLM"],
    )


def hf_rope(hf_config) -> tuple[str, float]:
    """(rope type, rope theta) as transformers' config class read config.json: transformers 5 gathers a top-level
    rope_theta and rope_scaling (transformers 4's form, most published Llama folders') into rope_parameters;
    transformers 4 keeps them as attributes of those names."""
    rope = getattr(hf_config, "rope_parameters", None) or {}
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    kind = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    return kind, float(rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))


def _hf_refusal(hf_config) -> str | None:
    """Why our model cannot express this HF Llama config, or None."""
    rope_type = hf_rope(hf_config)[0]
    heads = hf_config.num_attention_heads
    mlp = FAMILY_PARTS[HF_LLAMA][1]  # the gated MLP whose activation config.json's hidden_act names
    for wrong, what in (
            (hf_config.hidden_act != mlp.hf_activation,
             f"hidden_act {hf_config.hidden_act!r} (our {mlp.title} gates with {mlp.hf_activation})"),
            (rope_type != "default", f"rope_scaling/rope_parameters of type {rope_type!r} (ours rotates with plain "
                                     "theta: rope_type 'default')"),
            (getattr(hf_config, "attention_bias", False), "attention_bias true (our Llama has no biases)"),
            (getattr(hf_config, "mlp_bias", False), "mlp_bias true (our Llama has no biases)"),
            (getattr(hf_config, "head_dim", None) not in (None, hf_config.hidden_size // heads),
             f"head_dim {getattr(hf_config, 'head_dim', None)} (ours is hidden_size / num_attention_heads)")):
        if wrong:
            return f"{what} cannot be expressed"
    return None


def from_hf_config(hf_config, padded_vocab_size: int) -> GPTConfig:
    if getattr(hf_config, "model_type", None) != "llama":
        raise ValueError(f"expected a Llama config (model_type 'llama'), got {hf_config.model_type!r}")
    refusal = _hf_refusal(hf_config)
    if refusal:
        raise ValueError(refusal)
    return GPTConfig(
        num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
        num_attention_heads=hf_config.num_attention_heads, num_key_value_heads=hf_config.num_key_value_heads,
        seq_length=hf_config.max_position_embeddings, max_position_embeddings=hf_config.max_position_embeddings,
        padded_vocab_size=padded_vocab_size, ffn_hidden_size=hf_config.intermediate_size,
        hidden_dropout=0.0, attention_dropout=hf_config.attention_dropout, layernorm_epsilon=hf_config.rms_norm_eps,
        init_method_std=hf_config.initializer_range, rope_theta=hf_rope(hf_config)[1],
        **{**LLAMA, "untie_embeddings_and_output_weights": not hf_config.tie_word_embeddings},
    )


def qkv_to_hf(ours: torch.Tensor, config: GPTConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[(kv_head, (q x group, k, v), d), in] -> q_proj [(head, d), in], k_proj and v_proj [(kv_head, d), in]."""
    group, d = config.num_attention_heads // config.num_key_value_heads, config.head_dim
    grouped = ours.reshape(config.num_key_value_heads, group + 2, d, ours.shape[-1])
    parts = (grouped[:, :group], grouped[:, group], grouped[:, group + 1])
    return tuple(part.reshape(-1, ours.shape[-1]) for part in parts)


def qkv_from_hf(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: GPTConfig) -> torch.Tensor:
    kv, d, width = config.num_key_value_heads, config.head_dim, q.shape[-1]
    grouped = torch.cat([q.reshape(kv, -1, d, width), k.reshape(kv, 1, d, width), v.reshape(kv, 1, d, width)], dim=1)
    return grouped.reshape(-1, width)


def state_dict_to_hf(ours: dict[str, torch.Tensor], config: GPTConfig, vocab_size: int) -> dict[str, torch.Tensor]:
    """Our (full, TP=1) state dict -> LlamaForCausalLM's, the padded vocabulary rows cut off."""
    words = ours["word_embeddings.weight"][:vocab_size]
    output = ours["output_layer.weight"][:vocab_size] if config.untie_embeddings_and_output_weights else words
    hf = {"model.embed_tokens.weight": words, "lm_head.weight": output,
          "model.norm.weight": ours["final_layernorm.weight"]}
    names = layer_recipe(config).hf_names(HF_LLAMA)
    for i in range(config.num_layers):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        q, k, v = qkv_to_hf(ours[f"{src}self_attention.query_key_value.weight"], config)
        hf.update({f"{dst}self_attn.q_proj.weight": q, f"{dst}self_attn.k_proj.weight": k,
                   f"{dst}self_attn.v_proj.weight": v})
        hf.update(to_hf_layer(ours, src, dst, names))
    return {name: tensor.float().contiguous() for name, tensor in hf.items()}


def _padded(rows: torch.Tensor, padded: int) -> torch.Tensor:
    """The vocabulary padded with mean rows, as hf_gpt2.state_dict_from_hf pads it (and for the same reason)."""
    if padded < rows.shape[0]:
        raise ValueError(f"HF vocabulary {rows.shape[0]} is larger than the padded vocab size {padded}")
    return torch.cat([rows, rows.mean(0, keepdim=True).expand(padded - rows.shape[0], -1)])


def state_dict_from_hf(hf: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """LlamaForCausalLM's state dict -> ours, the vocabulary padded to config.padded_vocab_size."""
    ours = {"word_embeddings.weight": _padded(hf["model.embed_tokens.weight"], config.padded_vocab_size),
            "final_layernorm.weight": hf["model.norm.weight"]}
    if config.untie_embeddings_and_output_weights:
        ours["output_layer.weight"] = _padded(hf["lm_head.weight"], config.padded_vocab_size)
    names = layer_recipe(config).hf_names(HF_LLAMA)
    for i in range(config.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        ours[f"{dst}self_attention.query_key_value.weight"] = qkv_from_hf(
            *(hf[f"{src}self_attn.{name}_proj.weight"] for name in "qkv"), config)
        ours.update(from_hf_layer(hf, src, dst, names))
    return {name: tensor.float().contiguous() for name, tensor in ours.items()}
