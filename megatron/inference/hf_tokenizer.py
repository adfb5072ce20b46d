"""A run's Llama tokenizer (--tokenizer-model) as Hugging Face tokenizer files (tokenizer.json and
tokenizer_config.json), ids equal to ours: BOS first, special tokens where our tokenizers put them."""
from __future__ import annotations

import os
import shutil
import tempfile

from megatron.tokenizer import TokenizerConfig

LLAMA_TOKENIZERS = ("Llama2Tokenizer", "Llama3Tokenizer")


def save_llama_tokenizer(tokenizer: TokenizerConfig, folder: str) -> None:
    """Write the HF files of a Llama2Tokenizer (SentencePiece) or Llama3Tokenizer (tiktoken BPE) into folder."""
    import transformers

    if tokenizer.tokenizer_type == "Llama2Tokenizer":
        with tempfile.TemporaryDirectory(prefix="zero_lab_sp") as tmp:
            shutil.copyfile(tokenizer.tokenizer_model, os.path.join(tmp, "tokenizer.model"))
            hf = transformers.LlamaTokenizer.from_pretrained(tmp, local_files_only=True, add_bos_token=True,
                                                             add_eos_token=False)
    else:
        hf = _llama3_tokenizer(tokenizer.tokenizer_model)
    hf.save_pretrained(folder)


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
