"""Tokenize a jsonl corpus into Megatron's mmap indexed dataset.

    python tools/preprocess_data.py --input corpus.jsonl[.gz] --output-prefix data/my \
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt \
        --append-eod --workers 2

writes `{output-prefix}_{key}_document.bin/.idx` for every --json-keys key. Megatron's flags,
a different engine: instead of a process pool that pickles every document, lines are read in
large chunks, tiktoken encodes a whole chunk on --workers threads (it releases the GIL), and
each chunk's ids are appended to the .bin with one write. Bad lines stop the run with
`error: FILE:LINE: ...` and no output files (unless --skip-bad-lines).
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path

import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from megatron.data.indexed_dataset import (  # noqa: E402
    IndexedDatasetError,
    MMapIndexedDatasetBuilder,
    best_fitting_dtype,
    data_file_path,
    index_file_path,
)
from megatron.tokenizer import TOKENIZER_TYPES, TokenizerError, build_tokenizer  # noqa: E402

CHUNK_BYTES = 8 << 20  # large enough to amortize thread start-up, small enough to bound memory


class PreprocessError(Exception):
    """Bad input or flags; the message names the file and line or the flag."""


@dataclass
class PreprocessConfig:
    input: str
    output_prefix: str
    json_keys: list[str] = field(default_factory=lambda: ["text"])
    tokenizer_type: str = "GPT2BPETokenizer"
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_model: str | None = None
    vocab_size: int | None = None
    append_eod: bool = False
    workers: int = 1
    log_interval: int = 1000
    skip_bad_lines: bool = False
    chunk_bytes: int = CHUNK_BYTES  # not a flag: tests shrink it to cross chunk boundaries
    # Only the raw vocabulary matters for the data files; Megatron preprocesses unpadded too.
    make_vocab_size_divisible_by: int = 1
    tensor_model_parallel_size: int = 1

    def __post_init__(self):
        if self.workers < 1:
            raise PreprocessError(f"--workers {self.workers}: must be >= 1")
        if self.log_interval < 1:
            raise PreprocessError(f"--log-interval {self.log_interval}: must be >= 1")
        if not self.json_keys:
            raise PreprocessError("--json-keys: give at least one key")
        if not os.path.isfile(self.input):
            raise PreprocessError(f"--input {self.input}: file not found")


@dataclass
class Batch:
    """One chunk of parsed input: texts per key, input bytes, bad lines seen."""

    texts: dict[str, list[str]]
    num_bytes: int
    bad_lines: list[str]


def read_chunks(path: str, chunk_bytes: int):
    """Yield (number of the chunk's first line, raw lines) in chunks of about `chunk_bytes`."""
    opener = gzip.open if path.endswith(".gz") else open
    line_no = 1
    with opener(path, "rb") as source:
        while True:
            try:
                lines = source.readlines(chunk_bytes)
            except (OSError, EOFError) as err:  # corrupt or truncated gzip stream
                raise PreprocessError(f"{path}: cannot read ({err})") from None
            if not lines:
                return
            yield line_no, lines
            line_no += len(lines)


def parse_line(raw: bytes, keys: list[str]) -> list[str]:
    """The texts of `keys` in one jsonl line; raises ValueError with the reason."""
    try:
        line = raw.decode("utf-8").rstrip("\r\n")  # a newline inside an unterminated string is not the error
    except UnicodeDecodeError as err:
        raise ValueError(f"undecodable bytes (not UTF-8: byte {raw[err.start]:#04x} at column {err.start + 1})") from None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"malformed JSON ({err.msg}: column {err.colno})") from None
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    texts = []
    for key in keys:
        if key not in record:
            raise ValueError(f"missing key '{key}' (--json-keys; the line has: {', '.join(record) or 'no keys'})")
        if not isinstance(record[key], str):
            raise ValueError(f"key '{key}' holds {type(record[key]).__name__}, expected a string")
        texts.append(record[key])
    return texts


def parse_chunk(path: str, first_line: int, lines: list[bytes], cfg: PreprocessConfig) -> Batch:
    batch = Batch({key: [] for key in cfg.json_keys}, sum(map(len, lines)), [])
    for line_no, raw in enumerate(lines, start=first_line):
        if not raw.strip():
            continue  # blank lines (e.g. a trailing newline) are not records
        try:
            texts = parse_line(raw, cfg.json_keys)
        except ValueError as err:
            message = f"{path}:{line_no}: {err}"
            if not cfg.skip_bad_lines:
                raise PreprocessError(message) from None
            batch.bad_lines.append(message)
            continue
        for key, text in zip(cfg.json_keys, texts):
            batch.texts[key].append(text)
    return batch


def encode_texts(tokenizer, texts: list[str], cfg: PreprocessConfig, dtype) -> tuple[np.ndarray, np.ndarray]:
    """(all ids concatenated, tokens per document) for non-empty documents, eod appended if asked."""
    encoded = [ids for ids in tokenizer.tokenize_batch(texts, num_threads=cfg.workers) if ids]
    if cfg.append_eod:
        for ids in encoded:
            ids.append(tokenizer.eod)
    sizes = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
    flat = np.fromiter(chain.from_iterable(encoded), dtype=dtype, count=int(sizes.sum()))
    return flat, sizes


@dataclass
class Totals:
    documents: int = 0  # records read
    empty: int = 0  # documents left out because they have no tokens
    tokens: int = 0
    num_bytes: int = 0
    bad_lines: list[str] = field(default_factory=list)


def output_prefix(cfg: PreprocessConfig, key: str) -> str:
    return f"{cfg.output_prefix}_{key}_document"


def run(cfg: PreprocessConfig) -> Totals:
    tokenizer = build_tokenizer(cfg, verbose=False)
    dtype = best_fitting_dtype(tokenizer.vocab_size)
    Path(cfg.output_prefix).parent.mkdir(parents=True, exist_ok=True)
    builders = {key: MMapIndexedDatasetBuilder(data_file_path(output_prefix(cfg, key)), dtype) for key in cfg.json_keys}
    totals = Totals()
    progress = Progress(cfg)
    try:
        for first_line, lines in read_chunks(cfg.input, cfg.chunk_bytes):
            batch = parse_chunk(cfg.input, first_line, lines, cfg)
            for key, texts in batch.texts.items():
                flat, sizes = encode_texts(tokenizer, texts, cfg, dtype)
                builders[key].add_documents(flat, sizes)
                totals.tokens += int(sizes.sum())
                totals.empty += len(texts) - len(sizes)
            totals.documents += len(batch.texts[cfg.json_keys[0]])
            totals.num_bytes += batch.num_bytes
            totals.bad_lines += batch.bad_lines
            progress.show(totals)
        if totals.documents == 0:
            raise PreprocessError(f"{cfg.input}: no documents ({len(totals.bad_lines)} bad lines skipped)")
        for key, builder in builders.items():
            builder.finalize(index_file_path(output_prefix(cfg, key)))
    except BaseException:
        for builder in builders.values():
            builder.discard()
        raise
    finally:
        progress.close()
    return totals


class Progress:
    """tqdm bar over input bytes (MB/s) with documents and docs/s, refreshed every --log-interval docs."""

    def __init__(self, cfg: PreprocessConfig):
        # A gzip file's size is not the number of bytes read, so no total (and no ETA) then.
        total = None if cfg.input.endswith(".gz") else os.path.getsize(cfg.input)
        self._bar = tqdm(total=total, unit="B", unit_scale=True, desc="preprocess", file=sys.stderr,
                         mininterval=0.5, disable=None)
        self._interval = cfg.log_interval
        self._shown_documents = 0
        self._start = time.perf_counter()

    def show(self, totals: Totals) -> None:
        if totals.documents - self._shown_documents < self._interval:
            return
        self._shown_documents = totals.documents
        rate = totals.documents / max(time.perf_counter() - self._start, 1e-9)
        self._bar.set_postfix_str(f"{totals.documents} docs, {rate:.0f} docs/s", refresh=False)
        self._bar.update(totals.num_bytes - self._bar.n)

    def close(self) -> None:
        self._bar.close()


def report(cfg: PreprocessConfig, totals: Totals, seconds: float) -> None:
    for message in totals.bad_lines[:5]:
        print(f"skipped bad line: {message}", file=sys.stderr)
    if totals.bad_lines:
        print(f"skipped {len(totals.bad_lines)} bad lines (--skip-bad-lines)", file=sys.stderr)
    if totals.empty:
        print(f"skipped {totals.empty} documents with no tokens")
    for key in cfg.json_keys:
        print(f"wrote {data_file_path(output_prefix(cfg, key))} and {index_file_path(output_prefix(cfg, key))}")
    print(
        f"Processed {totals.documents} documents, {totals.tokens} tokens in {seconds:.3f} s "
        f"({totals.documents / seconds:.0f} docs/s, {totals.num_bytes / seconds / 1e6:.2f} MB/s)",
        flush=True,
    )


def parse_args(argv=None) -> PreprocessConfig:
    parser = argparse.ArgumentParser(description="Tokenize jsonl into Megatron's mmap .bin/.idx dataset.")
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True, help="jsonl file, optionally gzip-compressed (.jsonl.gz)")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract (default: text)")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", default="GPT2BPETokenizer", choices=TOKENIZER_TYPES)
    group.add_argument("--vocab-file", help="GPT-2 vocab.json")
    group.add_argument("--merge-file", help="GPT-2 merges.txt")
    group.add_argument("--tokenizer-model", help="SentencePiece model file")
    group.add_argument("--vocab-size", type=int, help="vocabulary size for NullTokenizer")
    group.add_argument("--append-eod", action="store_true", help="end every document with the eod token")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True, help="writes PREFIX_{key}_document.bin/.idx")
    group.add_argument("--dataset-impl", default="mmap", choices=["mmap"],
                       help="accepted for Megatron scripts; mmap is the only format")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizer threads")
    group.add_argument("--log-interval", type=int, default=1000, help="documents between progress updates")
    group.add_argument("--skip-bad-lines", action="store_true",
                       help="count and report malformed lines instead of stopping at the first")
    args = vars(parser.parse_args(argv))
    del args["dataset_impl"]
    return PreprocessConfig(**args)


def main(argv=None) -> int:
    start = time.perf_counter()
    try:
        cfg = parse_args(argv)
        totals = run(cfg)
    except (PreprocessError, TokenizerError, IndexedDatasetError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    report(cfg, totals, time.perf_counter() - start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
