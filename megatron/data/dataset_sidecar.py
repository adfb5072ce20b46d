"""`PREFIX.meta.json`, the small file beside a `.bin/.idx` pair that says what built it, and the
start-up check of every dataset of a blend against the model's vocabulary.

The `.bin/.idx` pair stays byte-identical to Megatron's format; what Megatron's files cannot say
lives here (docs/data-format.md): the largest token id (so the check costs one small read), the
source file's size and mtime, and the tokenizer (type, vocabulary size, sha256 of its files).
A dataset without a sidecar (built by upstream Megatron or merged) is scanned once with numpy
over the memory map instead. This module imports neither torch nor the tokenizer's packages at
import time, so the data tools start fast.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np

from megatron.data.indexed_dataset import MMapIndexedDataset, data_file_path
from megatron.errors import ZeroLabError

FORMAT = "zero-lab dataset sidecar"
VERSION = 1
# The tokenizer flags whose files define the vocabulary, per --tokenizer-type.
TOKENIZER_FILES = {
    "GPT2BPETokenizer": ("vocab_file", "merge_file"),
    "SentencePieceTokenizer": ("tokenizer_model",),
    "GPTSentencePieceTokenizer": ("tokenizer_model",),
    "Llama2Tokenizer": ("tokenizer_model",),
    "Llama3Tokenizer": ("tokenizer_model",),
    "NullTokenizer": (),
}


class DataVocabularyError(ZeroLabError, ValueError):
    """A dataset holds token ids the model's embedding has no row for."""


def sidecar_path(prefix: str | os.PathLike) -> str:
    return f"{prefix}.meta.json"


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def tokenizer_record(cfg, vocab_size: int) -> dict:
    """What identifies a tokenizer: --tokenizer-type, its vocabulary size and the sha256 of the
    files its flags name (`cfg` is any object with Megatron's tokenizer attributes)."""
    files = {flag: {"name": os.path.basename(str(getattr(cfg, flag))), "sha256": file_sha256(getattr(cfg, flag))}
             for flag in TOKENIZER_FILES.get(cfg.tokenizer_type, ()) if getattr(cfg, flag, None)}
    return {"type": cfg.tokenizer_type, "vocab_size": int(vocab_size), "files": files}


def source_record(path: str | os.PathLike) -> dict:
    stat = os.stat(path)
    return {"path": os.path.realpath(path), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def write_sidecar(prefix: str | os.PathLike, max_token_id: int, source: dict, tokenizer: dict) -> None:
    """Write PREFIX.meta.json for the finished PREFIX.bin (temporary name, then rename)."""
    record = {"format": FORMAT, "version": VERSION, "bin_bytes": os.path.getsize(data_file_path(prefix)),
              "max_token_id": int(max_token_id), "source": source, "tokenizer": tokenizer}
    path = sidecar_path(prefix)
    temp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(temp, "w", encoding="utf-8") as handle:
            json.dump(record, handle, indent=1)
            handle.write("\n")
        os.replace(temp, path)
    finally:
        Path(temp).unlink(missing_ok=True)


def read_sidecar(prefix: str | os.PathLike) -> dict | None:
    """The sidecar of PREFIX, or None when there is none or it does not describe this PREFIX.bin
    (unreadable, another format, or written for a .bin of another size): the data is then
    described by scanning it, never by a stale record."""
    try:
        with open(sidecar_path(prefix), encoding="utf-8") as handle:
            record = json.load(handle)
        matches = (record.get("format") == FORMAT and record.get("version") == VERSION
                   and record.get("bin_bytes") == os.path.getsize(data_file_path(prefix))
                   and isinstance(record.get("max_token_id"), int))
    except (OSError, ValueError, AttributeError):
        return None
    return record if matches else None


def scan_max_token_id(prefix: str | os.PathLike) -> int:
    """The largest id in PREFIX.bin, read with numpy over the memory map (-1 when empty)."""
    dtype = MMapIndexedDataset(prefix).dtype  # also checks the pair is a valid dataset
    if os.path.getsize(data_file_path(prefix)) == 0:
        return -1
    return int(np.memmap(data_file_path(prefix), dtype=dtype.newbyteorder("<"), mode="r").max())


def same_tokenizer(a: dict, b: dict) -> bool:
    hashes = [{flag: f.get("sha256") for flag, f in t.get("files", {}).items()} for t in (a, b)]
    return a.get("type") == b.get("type") and a.get("vocab_size") == b.get("vocab_size") and hashes[0] == hashes[1]


def describe_tokenizer(t: dict) -> str:
    """E.g. [GPT2BPETokenizer, 50257 ids, gpt2-vocab.json sha256:030878..., gpt2-merges.txt sha256:1ce166...]."""
    parts = [str(t.get("type")), f"{t.get('vocab_size')} ids"]
    parts += [f"{f['name']} sha256:{f['sha256'][:12]}" for f in t.get("files", {}).values()]
    return "[" + ", ".join(parts) + "]"


def source_change(record: dict) -> str:
    """How the source file differs from when the data was built, or "" (unchanged or gone)."""
    source = record.get("source") or {}
    try:
        stat = os.stat(source["path"])
    except (KeyError, TypeError, OSError):
        return ""  # data shipped without its source: nothing to compare
    if (stat.st_size, stat.st_mtime_ns) == (source.get("bytes"), source.get("mtime_ns")):
        return ""
    return f"{source['path']} changed since the data was built ({source.get('bytes')} -> {stat.st_size} bytes)"


def staleness(prefix: str | os.PathLike, source: str | os.PathLike, tokenizer: dict) -> str:
    """Why PREFIX.bin/.idx must be rebuilt from `source` with `tokenizer`, or "" when it is up to date."""
    record = read_sidecar(prefix)
    if record is None:
        return f"{sidecar_path(prefix)} missing or not describing {data_file_path(prefix)}"
    if os.path.realpath(source) != (record.get("source") or {}).get("path"):
        return f"built from {(record.get('source') or {}).get('path')}, not {os.path.realpath(source)}"
    if not same_tokenizer(record.get("tokenizer") or {}, tokenizer):
        return f"built with {describe_tokenizer(record.get('tokenizer') or {})}, not {describe_tokenizer(tokenizer)}"
    return source_change(record)


def other_kind_of_tokenizer(a: dict, b: dict) -> bool:
    """Another type or vocabulary size: the ids mean other pieces. (The same type and size with other file bytes
    may be the same vocabulary written differently, e.g. GPT-2's from the hub or from tools/gpt2_vocab.py.)"""
    return (a.get("type"), a.get("vocab_size")) != (b.get("type"), b.get("vocab_size"))


def check_data_against_model(data_path: list[str], tokenizer_cfg, vocab_size: int,
                             padded_vocab_size: int, allow_tokenizer_mismatch: bool = False) -> list[str]:
    """Check every dataset of Megatron's --data-path (one prefix or a weighted blend) before training.

    Raises DataVocabularyError when a dataset holds an id >= `padded_vocab_size` (the embedding has
    no row for it: an IndexError with TP=1, silently zeroed embeddings with TP>1), and when its sidecar says it
    was built with a tokenizer of another type or vocabulary size than `tokenizer_cfg`'s, unless
    `allow_tokenizer_mismatch` (--allow-tokenizer-mismatch). Returns warnings for the caller to print once: ids
    between the tokenizer's vocabulary and the padded one, data built with other tokenizer files of the same
    type and size (or another tokenizer, allowed), or data older than its source file.
    """
    # Imported here: dataset_utils pulls in torch, which the data tools importing this module avoid.
    from megatron.data.dataset_utils import parse_data_path

    run_tokenizer = tokenizer_record(tokenizer_cfg, vocab_size)
    warnings = []
    for prefix in dict.fromkeys(prefix for _, prefix in parse_data_path(data_path)):
        record = read_sidecar(prefix)
        max_id = record["max_token_id"] if record is not None else scan_max_token_id(prefix)
        where = f"--data-path {prefix}: {data_file_path(prefix)}"
        if max_id >= padded_vocab_size:
            raise DataVocabularyError(
                f"{where} holds token id {max_id} but the model's padded vocabulary has "
                f"{padded_vocab_size} ids {describe_tokenizer(run_tokenizer)}; the data was made with another "
                "tokenizer: rebuild it with tools/preprocess_data.py and this run's tokenizer flags")
        if max_id >= vocab_size:
            warnings.append(f"{where} holds token id {max_id}, beyond the tokenizer's {vocab_size} ids "
                            "(within the padded vocabulary): was it made with another tokenizer?")
        if record is None:
            continue
        built_with = record.get("tokenizer") or {}
        if other_kind_of_tokenizer(built_with, run_tokenizer) and not allow_tokenizer_mismatch:
            raise DataVocabularyError(
                f"{where} was built with {describe_tokenizer(built_with)} but this run uses "
                f"{describe_tokenizer(run_tokenizer)}: rebuild the data with this run's tokenizer "
                "(tools/preprocess_data.py), or pass --allow-tokenizer-mismatch to train on it anyway")
        if not same_tokenizer(built_with, run_tokenizer):
            warnings.append(f"{where} was built with {describe_tokenizer(built_with)} but this run uses "
                            f"{describe_tokenizer(run_tokenizer)}")
        change = source_change(record)
        if change:
            warnings.append(f"{where} is older than its source: {change}; rebuild it (tools/preprocess_data.py)")
    return warnings


def main(argv=None) -> int:
    """`python -m megatron.data.dataset_sidecar PREFIX --source FILE <tokenizer flags>`: exit 0 when
    PREFIX.bin/.idx were built from FILE as it is now with this tokenizer, else print why and exit 1
    (used by tools/process_databricks_gpt2.sh to decide whether to rebuild)."""
    from megatron.tokenizer import TokenizerConfig, TokenizerError, build_tokenizer

    parser = argparse.ArgumentParser(description=main.__doc__.split("\n")[0])
    parser.add_argument("prefix")
    parser.add_argument("--source", required=True)
    parser.add_argument("--tokenizer-type", default="GPT2BPETokenizer", choices=TOKENIZER_FILES)
    for flag in ("--vocab-file", "--merge-file", "--tokenizer-model"):
        parser.add_argument(flag)
    parser.add_argument("--vocab-size", type=int)
    args = parser.parse_args(argv)
    cfg = TokenizerConfig(tokenizer_type=args.tokenizer_type, vocab_file=args.vocab_file,
                          merge_file=args.merge_file, tokenizer_model=args.tokenizer_model, vocab_size=args.vocab_size)
    try:
        wanted = tokenizer_record(cfg, build_tokenizer(cfg, verbose=False).vocab_size)
        reason = staleness(args.prefix, args.source, wanted)
    except (TokenizerError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if reason:
        print(f"stale: {args.prefix}: {reason}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
