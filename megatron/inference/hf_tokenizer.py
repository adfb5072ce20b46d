"""A run's tokenizer as Hugging Face tokenizer files (tokenizer.json and tokenizer_config.json, written by
transformers' own tokenizer classes), ids equal to ours, plus the files zero-lab's tokenizer reads back, so that
AutoTokenizer and tools/generate_text.py --hf both load the folder with no flag."""
from __future__ import annotations

import os
import shutil
import tempfile

from megatron.tokenizer import TokenizerConfig

LLAMA_TOKENIZERS = ("Llama2Tokenizer", "Llama3Tokenizer")
# where zero-lab's own tokenizer files go in the folder: GPT-2's names, Llama-2's tokenizer.model and Llama-3's
# original/tokenizer.model, as Hugging Face's GPT-2 and Meta's Llama folders hold them
GPT2_FILES = {"vocab_file": "vocab.json", "merge_file": "merges.txt"}
LLAMA_MODEL_FILES = {"Llama2Tokenizer": "tokenizer.model", "Llama3Tokenizer": os.path.join("original",
                                                                                           "tokenizer.model")}


def save_hf_tokenizer(tokenizer: TokenizerConfig, folder: str) -> None:
    """Write the HF files of a GPT2BPETokenizer, Llama2Tokenizer or Llama3Tokenizer into folder, with the files the
    tokenizer was built from under the names tokenizer_in_folder reads; another tokenizer writes nothing."""
    import transformers

    if tokenizer.tokenizer_type not in ("GPT2BPETokenizer", *LLAMA_TOKENIZERS):
        return

    if tokenizer.tokenizer_type == "GPT2BPETokenizer":
        for key, name in GPT2_FILES.items():
            shutil.copyfile(getattr(tokenizer, key), os.path.join(folder, name))
        # read from vocab.json and merges.txt as from a published GPT-2 folder; no BOS added, as ours adds none
        transformers.GPT2TokenizerFast.from_pretrained(folder, local_files_only=True).save_pretrained(folder)
        return
    if tokenizer.tokenizer_type == "Llama2Tokenizer":
        with tempfile.TemporaryDirectory(prefix="zero_lab_sp") as tmp:
            shutil.copyfile(tokenizer.tokenizer_model, os.path.join(tmp, "tokenizer.model"))
            transformers.LlamaTokenizer.from_pretrained(tmp, local_files_only=True, add_bos_token=True,
                                                        add_eos_token=False).save_pretrained(folder)
    else:
        _llama3_tokenizer(tokenizer.tokenizer_model).save_pretrained(folder)
    model_file = os.path.join(folder, LLAMA_MODEL_FILES[tokenizer.tokenizer_type])
    os.makedirs(os.path.dirname(model_file), exist_ok=True)
    shutil.copyfile(tokenizer.tokenizer_model, model_file)


def tokenizer_in_folder(folder: str, make_vocab_size_divisible_by: int) -> TokenizerConfig | None:
    """The zero-lab tokenizer whose files save_hf_tokenizer (or Hugging Face's GPT-2, Meta's Llama) left in folder."""
    files = {key: os.path.join(folder, name) for key, name in GPT2_FILES.items()}
    if all(os.path.isfile(path) for path in files.values()):
        return TokenizerConfig(make_vocab_size_divisible_by=make_vocab_size_divisible_by, **files)
    for tokenizer_type, name in LLAMA_MODEL_FILES.items():
        if os.path.isfile(os.path.join(folder, name)):
            return TokenizerConfig(tokenizer_type=tokenizer_type, tokenizer_model=os.path.join(folder, name),
                                   make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    return None


def _llama3_tokenizer(model_file: str):
    import transformers
    from tokenizers import AddedToken, processors
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from megatron.tokenizer.llama3_bpe import LLAMA3_PAT_STR, LLAMA3_SPECIAL_TOKENS

    backend = TikTokenConverter(vocab_file=model_file, pattern=LLAMA3_PAT_STR).converted()
    # appended in order after the BPE ranks, as megatron/tokenizer/llama3_bpe.py numbers them
    backend.add_special_tokens([AddedToken(token, special=True) for token in LLAMA3_SPECIAL_TOKENS])
    bos = backend.token_to_id("<|begin_of_text|>")
    backend.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                           special_tokens=[("<|begin_of_text|>", bos)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|begin_of_text|>",
                                                eos_token="<|end_of_text|>")
