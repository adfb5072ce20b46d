"""Megatron-LM's Llama3Tokenizer (--tokenizer-type Llama3Tokenizer --tokenizer-model FILE).

It reads the `tokenizer.model` Llama-3 ships (`original/tokenizer.model`): a tiktoken
BPE file, one `<base64 token> <rank>` per line, ranks 0..N-1 (N = 128,000), encoded with Llama-3's
split regex; its 256 special tokens follow at N.. (<|begin_of_text|> 128000, <|end_of_text|>
128001, ..., <|eot_id|> 128009), so the vocabulary is N + 256 (128,256). It begins every non-empty
document with BOS, as Megatron-LM's does, and --append-eod ends it with <|end_of_text|>. Nothing
here downloads: the file is a local path.
"""
from __future__ import annotations

import base64
import binascii
import os

import tiktoken

from megatron.tokenizer.errors import TokenizerError
from megatron.tokenizer.gpt2_bpe import encode_in_threads

# Llama-3's pre-tokenization regex (meta-llama/llama3, llama/tokenizer.py).
LLAMA3_PAT_STR = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
NUM_SPECIAL_TOKENS = 256
LLAMA3_SPECIAL_TOKENS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
    "<|reserved_special_token_2|>", "<|reserved_special_token_3|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|reserved_special_token_4|>", "<|eot_id|>",
] + [f"<|reserved_special_token_{i}|>" for i in range(5, NUM_SPECIAL_TOKENS - 5)]
OFFLINE_HINT = ("a local file: zero-lab downloads no tokenizer; copy the model's tokenizer.model "
                "(Llama-3: original/tokenizer.model) to this machine and give its path")


def require_local_file(path: str) -> None:
    if not os.path.isfile(path):
        raise TokenizerError(f"--tokenizer-model {path}: file not found ({OFFLINE_HINT})")


def _parse_rank_line(path: str, line_no: int, line: bytes) -> tuple[bytes, int]:
    fields = line.split()
    try:
        if len(fields) != 2:
            raise ValueError
        return base64.b64decode(fields[0], validate=True), int(fields[1])
    except (ValueError, binascii.Error):
        shown = line[:60].decode("utf-8", "replace")
        raise TokenizerError(f"--tokenizer-model {path}:{line_no}: expected '<base64 token> <rank>', "
                             f"got {shown!r} (not a tiktoken BPE file?)") from None


def load_tiktoken_ranks(path: str) -> dict[bytes, int]:
    """The mergeable ranks of a tiktoken BPE file, checked: unique tokens, ranks 0..N-1 each once,
    every single byte present (tiktoken's byte-level BPE panics on a byte it has no rank for)."""
    require_local_file(path)
    try:
        with open(path, "rb") as source:
            lines = source.read().splitlines()
    except OSError as err:
        raise TokenizerError(f"--tokenizer-model {path}: cannot read ({err.strerror or err})") from None
    ranks: dict[bytes, int] = {}
    line_of_rank: dict[int, int] = {}
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        token, rank = _parse_rank_line(path, line_no, line)
        if token in ranks or rank in line_of_rank:
            what = f"token {token!r}" if token in ranks else f"rank {rank}"
            raise TokenizerError(f"--tokenizer-model {path}:{line_no}: {what} appears twice")
        ranks[token] = rank
        line_of_rank[rank] = line_no
    if not ranks:
        raise TokenizerError(f"--tokenizer-model {path}: empty (expected '<base64 token> <rank>' lines)")
    if max(line_of_rank) != len(ranks) - 1 or min(line_of_rank) != 0:
        missing = next(i for i in range(len(ranks)) if i not in line_of_rank)
        raise TokenizerError(f"--tokenizer-model {path}: ranks must be 0..{len(ranks) - 1}, each once; "
                             f"rank {missing} is missing")
    absent = [b for b in range(256) if bytes([b]) not in ranks]
    if absent:
        raise TokenizerError(f"--tokenizer-model {path}: no token for byte {absent[0]:#04x} "
                             f"({len(absent)} of 256 bytes missing; a byte-level BPE needs them all)")
    return ranks


class Llama3Tokenizer:
    """Megatron-LM's Llama3Tokenizer: Llama-3's tiktoken file and split regex, BOS first, eod = <|end_of_text|>."""

    name = "Llama3Tokenizer"

    def __init__(self, model_file: str):
        ranks = load_tiktoken_ranks(model_file)
        special = {token: len(ranks) + i for i, token in enumerate(LLAMA3_SPECIAL_TOKENS)}
        clash = next((token for token in special if token.encode() in ranks), None)
        if clash is not None:
            raise TokenizerError(f"--tokenizer-model {model_file}: holds the special token {clash} as a BPE token")
        self._encoding = tiktoken.Encoding(name=f"llama3:{model_file}", pat_str=LLAMA3_PAT_STR,
                                           mergeable_ranks=ranks, special_tokens=special)
        self.bos, self._eod = special["<|begin_of_text|>"], special["<|end_of_text|>"]

    @property
    def vocab_size(self) -> int:
        return self._encoding.n_vocab

    @property
    def eod(self) -> int:
        return self._eod

    def _encode(self, text: str) -> list[int]:
        # encode_ordinary: "<|eot_id|>" inside a document is plain text, not a special token
        return [self.bos, *self._encoding.encode_ordinary(text)] if text else []

    def tokenize(self, text: str) -> list[int]:
        return self._encode(text)

    def tokenize_batch(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        return encode_in_threads(self._encode, texts, num_threads)

    def detokenize(self, ids) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:  # e.g. a padded-vocabulary id sampled from the model's extra logits
            raise TokenizerError(f"Llama3Tokenizer: id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return self._encoding.decode(ids)
