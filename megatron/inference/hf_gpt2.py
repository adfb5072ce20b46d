"""Weight and config mapping between our GPTModel and Hugging Face's GPT2LMHeadModel.

The layer's names besides QKV are its recipe's (megatron/model/recipe.py). Two layout differences matter. HF's
Conv1D stores every linear weight as [in, out] (the transpose of nn.Linear). HF's fused c_attn splits its output as
[q | k | v], each over all heads, while our query_key_value is laid out per head as [head, (q, k, v), head_dim] so
that a tensor-parallel column split hands every rank whole heads.
"""
from __future__ import annotations

import torch

from megatron.model import GPTConfig
from megatron.model.recipe import HF_GPT2, from_hf_layer, layer_recipe, to_hf_layer

_TOP_MAP = (
    ("position_embeddings.weight", "transformer.wpe.weight"),
    ("final_layernorm.weight", "transformer.ln_f.weight"),
    ("final_layernorm.bias", "transformer.ln_f.bias"),
)


def qkv_to_hf(ours: torch.Tensor, heads: int) -> torch.Tensor:
    """[(head, qkv, d), in] weight or [(head, qkv, d)] bias -> HF c_attn [in, (qkv, head, d)] / [(qkv, head, d)]."""
    rest = ours.shape[1:]
    regrouped = ours.reshape(heads, 3, -1, *rest).transpose(0, 1).reshape(-1, *rest)
    return regrouped.t() if ours.dim() == 2 else regrouped


def qkv_from_hf(theirs: torch.Tensor, heads: int) -> torch.Tensor:
    rows = theirs.t() if theirs.dim() == 2 else theirs
    rest = rows.shape[1:]
    return rows.reshape(3, heads, -1, *rest).transpose(0, 1).reshape(-1, *rest)


def to_hf_config(config: GPTConfig, vocab_size: int, eod: int | None):
    """A GPT2Config with our shapes; dropouts as trained, so fine-tuning with HF keeps them."""
    import transformers

    return transformers.GPT2Config(
        vocab_size=vocab_size, n_positions=config.max_position_embeddings, n_embd=config.hidden_size,
        n_layer=config.num_layers, n_head=config.num_attention_heads,
        n_inner=None if config.ffn_hidden_size == 4 * config.hidden_size else config.ffn_hidden_size,
        activation_function="gelu_new",  # GELU with the tanh approximation, as our MLP
        layer_norm_epsilon=config.layernorm_epsilon, initializer_range=config.init_method_std,
        resid_pdrop=config.hidden_dropout, embd_pdrop=config.hidden_dropout, attn_pdrop=config.attention_dropout,
        bos_token_id=eod, eos_token_id=eod, tie_word_embeddings=True, architectures=["GPT2LMHeadModel"],
    )


def from_hf_config(hf_config, padded_vocab_size: int) -> GPTConfig:
    if getattr(hf_config, "model_type", None) != "gpt2":
        raise ValueError(f"expected a GPT-2 config (model_type 'gpt2'), got {getattr(hf_config, 'model_type', None)!r}")
    if hf_config.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"activation_function {hf_config.activation_function!r} is not supported "
                         "(our MLP uses GELU with the tanh approximation: gelu_new)")
    return GPTConfig(
        num_layers=hf_config.n_layer, hidden_size=hf_config.n_embd, num_attention_heads=hf_config.n_head,
        seq_length=hf_config.n_positions, max_position_embeddings=hf_config.n_positions,
        padded_vocab_size=padded_vocab_size, ffn_hidden_size=hf_config.n_inner or 4 * hf_config.n_embd,
        hidden_dropout=hf_config.resid_pdrop, attention_dropout=hf_config.attn_pdrop,
        layernorm_epsilon=hf_config.layer_norm_epsilon, init_method_std=hf_config.initializer_range,
    )


def state_dict_to_hf(ours: dict[str, torch.Tensor], config: GPTConfig, vocab_size: int) -> dict[str, torch.Tensor]:
    """Our (full, TP=1) state dict -> GPT2LMHeadModel's, the padded vocabulary rows cut off."""
    heads, names = config.num_attention_heads, layer_recipe(config).hf_names(HF_GPT2)
    words = ours["word_embeddings.weight"][:vocab_size]
    hf = {"transformer.wte.weight": words, "lm_head.weight": words}
    hf.update({theirs: ours[name] for name, theirs in _TOP_MAP})
    for i in range(config.num_layers):
        src, dst = f"layers.{i}.", f"transformer.h.{i}."
        for suffix in ("weight", "bias"):
            hf[f"{dst}attn.c_attn.{suffix}"] = qkv_to_hf(ours[f"{src}self_attention.query_key_value.{suffix}"], heads)
        hf.update(to_hf_layer(ours, src, dst, names))
    return {name: tensor.float().contiguous() for name, tensor in hf.items()}


def state_dict_from_hf(hf: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """GPT2LMHeadModel's state dict -> ours, the vocabulary padded to config.padded_vocab_size.

    The padding rows are the mean embedding: GPT-2's logits sit far below zero, so zero rows
    (logit 0) would take most of the softmax mass and wreck the loss at the start of fine-tuning.
    """
    heads, names = config.num_attention_heads, layer_recipe(config).hf_names(HF_GPT2)
    words = hf["transformer.wte.weight"]
    padding = config.padded_vocab_size - words.shape[0]
    if padding < 0:
        raise ValueError(f"HF vocabulary {words.shape[0]} is larger than the padded vocab size "
                         f"{config.padded_vocab_size}")
    ours = {"word_embeddings.weight": torch.cat([words, words.mean(0, keepdim=True).expand(padding, -1)])}
    ours.update({name: hf[theirs] for name, theirs in _TOP_MAP})
    for i in range(config.num_layers):
        src, dst = f"transformer.h.{i}.", f"layers.{i}."
        for suffix in ("weight", "bias"):
            ours[f"{dst}self_attention.query_key_value.{suffix}"] = qkv_from_hf(hf[f"{src}attn.c_attn.{suffix}"], heads)
        ours.update(from_hf_layer(hf, src, dst, names))
    return {name: tensor.float().contiguous() for name, tensor in ours.items()}
