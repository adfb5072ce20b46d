"""Tokenizers with Megatron's --tokenizer-type names; see `build_tokenizer`."""
from megatron.tokenizer.errors import TokenizerError
from megatron.tokenizer.gpt2_bpe import GPT2BPETokenizer
from megatron.tokenizer.llama3_bpe import Llama3Tokenizer
from megatron.tokenizer.tokenizer import (
    TOKENIZER_TYPES,
    Llama2Tokenizer,
    NullTokenizer,
    SentencePieceTokenizer,
    TokenizerConfig,
    build_tokenizer,
    padded_vocab_size,
)

__all__ = [
    "TOKENIZER_TYPES",
    "GPT2BPETokenizer",
    "Llama2Tokenizer",
    "Llama3Tokenizer",
    "NullTokenizer",
    "SentencePieceTokenizer",
    "TokenizerConfig",
    "TokenizerError",
    "build_tokenizer",
    "padded_vocab_size",
]
