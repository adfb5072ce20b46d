"""Hugging Face GPT-2 folders (config.json + model.safetensors + vocab.json/merges.txt) in and out."""
from __future__ import annotations

import os
import shutil

import torch

from megatron.inference.hf_gpt2 import from_hf_config, state_dict_from_hf, state_dict_to_hf, to_hf_config
from megatron.saved_model.reader import LoadedCheckpoint, SavedModelError, check_state_dict
from megatron.tokenizer import TokenizerConfig, padded_vocab_size

HF_TOKENIZER_FILES = {"vocab_file": "vocab.json", "merge_file": "merges.txt"}


def load_hf_folder(path: str, make_vocab_size_divisible_by: int = 128) -> LoadedCheckpoint:
    """An HF GPT2LMHeadModel folder as our weights, the vocabulary padded as pretrain_gpt.py pads it."""
    import transformers

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise SavedModelError(f"--hf {path}: not a Hugging Face model folder (no config.json)")
    try:
        hf_config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        config = from_hf_config(hf_config, padded_vocab_size(hf_config.vocab_size, make_vocab_size_divisible_by))
        model = transformers.GPT2LMHeadModel.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    except (OSError, ValueError) as err:
        raise SavedModelError(f"--hf {path}: cannot load a GPT-2 model ({str(err).splitlines()[0]})") from None
    state_dict = state_dict_from_hf(model.state_dict(), config)
    check_state_dict(state_dict, config, path)
    files = {key: os.path.join(path, name) for key, name in HF_TOKENIZER_FILES.items()}
    tokenizer = TokenizerConfig(make_vocab_size_divisible_by=make_vocab_size_divisible_by, **files) \
        if all(os.path.isfile(f) for f in files.values()) else None
    return LoadedCheckpoint(path=path, iteration=0, config=config, state_dict=state_dict, tokenizer=tokenizer,
                            data_path=None, split=None)


def save_hf_folder(loaded: LoadedCheckpoint, output: str, vocab_size: int, eod: int | None,
                   tokenizer_files: dict[str, str]) -> str:
    """Write GPT2LMHeadModel's folder via save_pretrained (tmp name, renamed when complete)."""
    import transformers

    if not loaded.config.is_gpt2_shaped:
        raise SavedModelError(f"{loaded.path}: the model is Llama-shaped (RMSNorm, SwiGLU, grouped-query attention, "
                              "untied output or no biases), not GPT-2: no Hugging Face GPT-2 export")
    if loaded.config.use_rotary_position_embeddings:
        raise SavedModelError(f"{loaded.path}: the model has rotary positions (--use-rotary-position-embeddings), "
                              "which GPT-2 has not (it learns a position table): no Hugging Face GPT-2 export")
    if os.path.exists(output) and os.listdir(output):
        raise SavedModelError(f"--output {output}: folder exists and is not empty (refusing to overwrite)")
    hf_config = to_hf_config(loaded.config, vocab_size, eod)
    with torch.device("meta"):  # no random init of weights that are replaced next
        model = transformers.GPT2LMHeadModel(hf_config)
    model.load_state_dict(state_dict_to_hf(loaded.state_dict, loaded.config, vocab_size), strict=True, assign=True)
    model.tie_weights()
    tmp = f"{output.rstrip(os.sep)}.tmp-{os.getpid()}"
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        for key, src in tokenizer_files.items():
            shutil.copyfile(src, os.path.join(tmp, HF_TOKENIZER_FILES[key]))
        if os.path.isdir(output):
            os.rmdir(output)
        os.rename(tmp, output)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return output
