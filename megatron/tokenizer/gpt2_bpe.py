"""GPT-2 byte-level BPE from the standard `vocab.json` + `merges.txt`, encoded by tiktoken.

tiktoken runs the BPE in compiled code and treats a token's rank as its merge priority. GPT-2's
files satisfy that (merge line i creates token 256 + i), and `load_gpt2_bpe_ranks` checks it,
so tiktoken's ids are exactly GPT-2's. tiktoken's own `data_gym_to_mergeable_bpe_ranks` does the
same conversion but caches file contents in a shared temp dir keyed by path (stale when a file
at the same path changes) and fails with bare asserts, hence this small loader.
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

import numpy as np
import tiktoken

from megatron.tokenizer.errors import TokenizerError

# GPT-2's pre-tokenization regex (identical to tiktoken's "gpt2" encoding).
GPT2_PAT_STR = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
EOD_TOKEN = "<|endoftext|>"
MERGES_HEADER = "#version: 0.2"


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable unicode characters used in its files."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@lru_cache(maxsize=1)
def _byte_translation() -> dict[int, int]:
    """str.translate table from GPT-2's characters to latin-1 code points (= byte values).

    Characters below 256 that are not in GPT-2's alphabet (e.g. a raw space) map to a
    non-latin-1 sentinel so that encoding fails instead of passing them through.
    """
    table = {cp: 0xFFFF for cp in range(256)}
    table.update({ord(ch): b for b, ch in bytes_to_unicode().items()})
    return table


def unicode_to_bytes(token: str) -> bytes:
    """The bytes a vocab.json token stands for; UnicodeEncodeError if it is not byte-level BPE."""
    return token.translate(_byte_translation()).encode("latin-1")


def _is_byte_level(token: str) -> bool:
    try:
        unicode_to_bytes(token)
    except UnicodeEncodeError:
        return False
    return True


def _read_vocab(vocab_file: str) -> dict[str, int]:
    try:
        vocab = json.loads(Path(vocab_file).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TokenizerError(f"--vocab-file {vocab_file}: file not found") from None
    except OSError as err:
        raise TokenizerError(f"--vocab-file {vocab_file}: cannot read ({err.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise TokenizerError(f"--vocab-file {vocab_file}: not a GPT-2 vocab.json ({err})") from None
    if not isinstance(vocab, dict) or not all(isinstance(v, int) for v in vocab.values()):
        raise TokenizerError(f"--vocab-file {vocab_file}: expected a JSON object mapping tokens to integer ids")
    return vocab


def _read_merges(merge_file: str) -> list[str]:
    try:
        lines = Path(merge_file).read_text(encoding="utf-8").split("\n")
    except FileNotFoundError:
        raise TokenizerError(f"--merge-file {merge_file}: file not found") from None
    except OSError as err:
        raise TokenizerError(f"--merge-file {merge_file}: cannot read ({err.strerror})") from None
    except UnicodeDecodeError as err:
        raise TokenizerError(f"--merge-file {merge_file}: not UTF-8 text ({err})") from None
    if lines and lines[0].startswith("#version"):
        lines = lines[1:]
    return [line for line in lines if line]


def load_gpt2_bpe_ranks(vocab_file: str, merge_file: str) -> tuple[dict[bytes, int], dict[str, int]]:
    """(mergeable ranks for tiktoken, special tokens) from GPT-2 style vocab/merges files."""
    vocab = _read_vocab(vocab_file)
    merges = _read_merges(merge_file)
    special = {tok: idx for tok, idx in vocab.items() if tok.startswith("<|") and tok.endswith("|>")}
    try:
        ranks = {unicode_to_bytes(tok): idx for tok, idx in vocab.items() if tok not in special}
    except UnicodeEncodeError:
        bad = next(tok for tok in vocab if tok not in special and not _is_byte_level(tok))
        raise TokenizerError(f"--vocab-file {vocab_file}: token {bad!r} is not in GPT-2's byte-level alphabet") from None
    _check_merges_match_ranks(merges, vocab, vocab_file, merge_file)
    if len(ranks) != 256 + len(merges):
        raise TokenizerError(
            f"--vocab-file {vocab_file} has {len(ranks)} BPE tokens but --merge-file {merge_file} "
            f"has {len(merges)} merges (expected 256 + merges)"
        )
    return ranks, special


def _check_merges_match_ranks(merges: list[str], vocab: dict[str, int], vocab_file: str, merge_file: str) -> None:
    """tiktoken merges by token rank, GPT-2 by merge line: they agree iff ranks follow merge order."""
    # Fast path first (this runs at every start-up); the loop below only locates the bad line.
    merged_ids = [vocab.get(merge.replace(" ", "", 1)) for merge in merges]
    parts = {part for merge in merges for part in merge.split(" ")}
    if None not in merged_ids and parts <= vocab.keys() and all(merge.count(" ") == 1 for merge in merges):
        ids = np.array([255, *merged_ids], dtype=np.int64)
        if np.all(np.diff(ids) > 0):
            return
    previous = 255
    for line_no, merge in enumerate(merges, start=2):
        pair = merge.split(" ")
        merged = "".join(pair)
        if len(pair) != 2 or pair[0] not in vocab or pair[1] not in vocab or merged not in vocab:
            raise TokenizerError(f"--merge-file {merge_file}:{line_no}: merge {merge!r} does not match --vocab-file {vocab_file}")
        if vocab[merged] <= previous:
            raise TokenizerError(
                f"--merge-file {merge_file}:{line_no}: merge {merge!r} -> id {vocab[merged]} is out of merge order "
                f"in --vocab-file {vocab_file}"
            )
        previous = vocab[merged]


def encode_in_threads(encode, texts: list[str], num_threads: int) -> list[list[int]]:
    """`encode` over many texts; tiktoken releases the GIL, so threads run in parallel.

    Each thread gets a contiguous slice rather than one task per text (what tiktoken's
    encode_ordinary_batch does): per-task executor overhead costs more than short texts' BPE.
    """
    if num_threads <= 1 or len(texts) < 2:
        return [encode(text) for text in texts]
    step = -(-len(texts) // (4 * num_threads))  # a few slices per thread balance uneven texts
    slices = [texts[i : i + step] for i in range(0, len(texts), step)]
    with ThreadPoolExecutor(num_threads) as pool:
        encoded = pool.map(lambda part: [encode(text) for text in part], slices)
        return [ids for part in encoded for ids in part]


class GPT2BPETokenizer:
    """Megatron's GPT2BPETokenizer: ids identical to GPT-2's, eod = <|endoftext|> (50256)."""

    name = "GPT2BPETokenizer"

    def __init__(self, vocab_file: str, merge_file: str):
        ranks, special = load_gpt2_bpe_ranks(vocab_file, merge_file)
        if EOD_TOKEN not in special:
            raise TokenizerError(f"--vocab-file {vocab_file}: has no {EOD_TOKEN} token")
        self._encoding = tiktoken.Encoding(
            name=f"gpt2-bpe:{vocab_file}",
            pat_str=GPT2_PAT_STR,
            mergeable_ranks=ranks,
            special_tokens=special,
        )
        self._eod = special[EOD_TOKEN]

    @property
    def vocab_size(self) -> int:
        return self._encoding.n_vocab

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> list[int]:
        # encode_ordinary: "<|endoftext|>" inside text is plain text, as in GPT-2's own encoder.
        return self._encoding.encode_ordinary(text)

    def tokenize_batch(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        return encode_in_threads(self._encoding.encode_ordinary, texts, num_threads)

    def detokenize(self, ids) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            # e.g. a padded-vocabulary id sampled from the model's extra logits
            raise TokenizerError(f"GPT2BPETokenizer: id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return self._encoding.decode(ids)
