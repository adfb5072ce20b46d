"""Hugging Face GPT-2 and Llama folders (config.json + model.safetensors + the tokenizer's files) in and out."""
from __future__ import annotations

import os
import shutil

import torch

from megatron.inference import hf_gpt2, hf_llama
from megatron.inference.hf_tokenizer import save_hf_tokenizer, tokenizer_in_folder
from megatron.model.recipe import export_refusal
from megatron.saved_model.reader import LoadedCheckpoint, SavedModelError, check_state_dict
from megatron.tokenizer import TokenizerConfig, padded_vocab_size


def load_hf_folder(path: str, make_vocab_size_divisible_by: int = 128) -> LoadedCheckpoint:
    """An HF GPT2LMHeadModel or LlamaForCausalLM folder as our weights, the vocabulary padded as pretrain_gpt.py
    pads it, with the tokenizer whose files the folder holds (tools/checkpoint_to_hf.py writes them; None if none)."""
    import transformers

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise SavedModelError(f"--hf {path}: not a Hugging Face model folder (no config.json)")
    try:
        hf_config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        llama = getattr(hf_config, "model_type", None) == "llama"
        mapping, model_class = (hf_llama, transformers.LlamaForCausalLM) if llama else \
            (hf_gpt2, transformers.GPT2LMHeadModel)
        config = mapping.from_hf_config(hf_config, padded_vocab_size(hf_config.vocab_size,
                                                                     make_vocab_size_divisible_by))
        model = model_class.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    except (OSError, ValueError) as err:
        kind = "Llama" if llama else "GPT-2"
        raise SavedModelError(f"--hf {path}: cannot load a {kind} model ({str(err).splitlines()[0]})") from None
    state_dict = mapping.state_dict_from_hf(model.state_dict(), config)
    check_state_dict(state_dict, config, path)
    tokenizer = tokenizer_in_folder(path, make_vocab_size_divisible_by)
    return LoadedCheckpoint(path=path, iteration=0, config=config, state_dict=state_dict, tokenizer=tokenizer,
                            data_path=None, split=None)


def _hf_model(loaded: LoadedCheckpoint, vocab_size: int, bos: int | None, eod: int | None):
    """GPT2LMHeadModel or LlamaForCausalLM holding the checkpoint's weights; a model neither can hold is refused."""
    import transformers

    config = loaded.config
    if config.is_moe:
        raise SavedModelError(f"{loaded.path}: a mixture-of-experts checkpoint ({config.experts_setting}): Hugging "
                              "Face's GPT-2 and Llama have no experts to hold its expert weights: no Hugging Face "
                              "export (docs/moe.md)")
    refusal = export_refusal(config)
    if refusal:
        raise SavedModelError(f"{loaded.path}: {refusal}")
    if config.is_gpt2_shaped:
        if config.use_rotary_position_embeddings:
            raise SavedModelError(f"{loaded.path}: the model has rotary positions (--use-rotary-position-embeddings), "
                                  "which GPT-2 has not (it learns a position table): no Hugging Face GPT-2 export")
        mapping, model_class, hf_config = hf_gpt2, transformers.GPT2LMHeadModel, hf_gpt2.to_hf_config(
            config, vocab_size, eod)
    else:
        refusal = hf_llama.llama_refusal(config)
        if refusal:
            raise SavedModelError(f"{loaded.path}: the model is neither GPT-2 nor Llama shaped: {refusal}")
        mapping, model_class = hf_llama, transformers.LlamaForCausalLM
        hf_config = hf_llama.to_hf_config(config, vocab_size, bos, eod)
    with torch.device("meta"):  # no random init of weights that are replaced next
        model = model_class(hf_config)
    model.load_state_dict(mapping.state_dict_to_hf(loaded.state_dict, config, vocab_size), strict=True, assign=True)
    model.tie_weights()
    return model


def save_hf_folder(loaded: LoadedCheckpoint, output: str, vocab_size: int, tokenizer,
                   tokenizer_config: TokenizerConfig | None) -> str:
    """Write GPT2LMHeadModel's or LlamaForCausalLM's folder via save_pretrained (tmp name, renamed when complete),
    with the tokenizer's HF files and its own (hf_tokenizer.py), every file of the mode the umask gives."""
    if os.path.exists(output) and os.listdir(output):
        raise SavedModelError(f"--output {output}: folder exists and is not empty (refusing to overwrite)")
    bos, eod = getattr(tokenizer, "bos", None), getattr(tokenizer, "eod", None)
    model = _hf_model(loaded, vocab_size, bos, eod)
    tmp = f"{output.rstrip(os.sep)}.tmp-{os.getpid()}"
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        _umask_modes(tmp, ".safetensors")
        if tokenizer_config is not None:
            save_hf_tokenizer(tokenizer_config, tmp)
        if os.path.isdir(output):
            os.rmdir(output)
        os.rename(tmp, output)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return output


def _umask_modes(folder: str, suffix: str) -> None:
    """Give folder's files ending in suffix the mode a plain open() gives under the umask (0644 under 022), as the
    folder's other files have: safetensors writes model*.safetensors through a private temporary file (0600)."""
    umask = os.umask(0)
    os.umask(umask)
    for name in os.listdir(folder):
        if name.endswith(suffix):
            os.chmod(os.path.join(folder, name), 0o666 & ~umask)
