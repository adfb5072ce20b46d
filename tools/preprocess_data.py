"""Tokenize a jsonl corpus into Megatron's mmap indexed dataset.

    python tools/preprocess_data.py --input corpus.jsonl[.gz] --output-prefix data/my \
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt \
        --append-eod --workers 2

writes `{output-prefix}_{key}_document.bin/.idx` for every --json-keys key (--tokenizer-type
Llama2Tokenizer or Llama3Tokenizer with --tokenizer-model for Llama's tokenizer.model files). Megatron's flags,
a different engine: upstream sends every document to a process pool and back as Python lists;
here the main process reads ~1 MB chunks of raw lines, --workers forked processes each parse
and tokenize whole chunks (tiktoken, compiled BPE) and send back one numpy array of ids per
chunk, and the main process appends each array to the .bin with one write, in input order.
Beside each pair goes `{prefix}.meta.json` (megatron/data/dataset_sidecar.py): the largest token
id, the input's size and mtime, and the tokenizer, so training can check the data cheaply.
Bad lines stop the run with `error: FILE:LINE: ...` and no output files (unless --skip-bad-lines);
so do an output folder that cannot be written (checked before any work), a worker that dies
(killed, out of memory) and SIGTERM/SIGINT.
"""
from __future__ import annotations

import argparse
import ctypes
import gzip
import json
import multiprocessing
import os
import signal
import sys
import tempfile
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path

import numpy as np
from tqdm import tqdm

from megatron.data.dataset_sidecar import sidecar_path, source_record, tokenizer_record, write_sidecar
from megatron.data.indexed_dataset import (
    MMapIndexedDatasetBuilder,
    best_fitting_dtype,
    data_file_path,
    index_file_path,
)
from megatron.tokenizer import TOKENIZER_TYPES, TokenizerError, build_tokenizer
from megatron.errors import ZeroLabError

# One task: large enough that pickling/IPC is noise, small enough to balance workers and to
# overlap reading with tokenizing.
CHUNK_BYTES = 1 << 20


class PreprocessError(ZeroLabError):
    """Bad input or flags; the message names the file and line or the flag."""


class Stopped(BaseException):
    """SIGTERM or SIGINT arrived. A BaseException, as KeyboardInterrupt, so that cleanup runs on the
    way out and no `except Exception` swallows it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stopped(signum, frame):
    raise Stopped(signum)


@contextmanager
def stop_on_signals():
    """SIGTERM and SIGINT raise Stopped while the body runs (SIGINT stays ignored where the shell
    ignores it, as for a background job); the previous handlers come back afterwards."""
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    for signum, handler in previous.items():
        if handler is not signal.SIG_IGN:
            signal.signal(signum, _raise_stopped)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


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


@dataclass
class EncodedChunk:
    """One chunk's output: per key the ids of its non-empty documents and their sizes."""

    num_bytes: int
    records: int = 0
    arrays: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    empty: int = 0  # documents left out because they have no tokens
    bad_lines: list[str] = field(default_factory=list)


class ChunkEncoder:
    """Parses and tokenizes one chunk of lines (in a worker process when --workers > 1)."""

    def __init__(self, tokenizer, cfg: PreprocessConfig, dtype):
        self.tokenizer, self.cfg, self.dtype = tokenizer, cfg, dtype

    def __call__(self, chunk: tuple[int, list[bytes]]) -> EncodedChunk:
        first_line, lines = chunk
        result = EncodedChunk(num_bytes=sum(map(len, lines)))
        records = self._parse(first_line, lines, result)
        if result.bad_lines and not self.cfg.skip_bad_lines:
            return result  # the main process stops at the first bad line
        encoded = self._tokenize(records, result)
        result.records = len(encoded)
        for index, key in enumerate(self.cfg.json_keys):
            result.arrays[key] = self._to_arrays([ids[index] for ids in encoded], result)
        return result

    def _parse(self, first_line: int, lines: list[bytes], result: EncodedChunk) -> list[tuple[int, list[str]]]:
        """(line number, texts per key) of every good record."""
        records = []
        for line_no, raw in enumerate(lines, start=first_line):
            if not raw.strip():
                continue  # blank lines (e.g. a trailing newline) are not records
            try:
                records.append((line_no, parse_line(raw, self.cfg.json_keys)))
            except ValueError as err:
                result.bad_lines.append(f"{self.cfg.input}:{line_no}: {err}")
                if not self.cfg.skip_bad_lines:
                    break
        return records

    def _tokenize(self, records, result: EncodedChunk) -> list[list[list[int]]]:
        """Per record, the ids of each key. Whole keys at once; record by record only to
        find the line a tokenizer rejects (e.g. a non-integer for NullTokenizer)."""
        try:
            columns = [self.tokenizer.tokenize_batch([texts[i] for _, texts in records])
                       for i in range(len(self.cfg.json_keys))]
            return [list(ids) for ids in zip(*columns)]
        except TokenizerError:
            return self._tokenize_each(records, result)

    def _tokenize_each(self, records, result: EncodedChunk) -> list[list[list[int]]]:
        """Record by record, noting each line the tokenizer rejects (stopping at the first
        unless --skip-bad-lines)."""
        encoded = []
        for line_no, texts in records:
            try:
                encoded.append([self.tokenizer.tokenize(text) for text in texts])
            except TokenizerError as err:
                result.bad_lines.append(f"{self.cfg.input}:{line_no}: {err}")
                if not self.cfg.skip_bad_lines:
                    break
        return encoded

    def _to_arrays(self, documents: list[list[int]], result: EncodedChunk) -> tuple[np.ndarray, np.ndarray]:
        kept = [ids for ids in documents if ids]
        result.empty += len(documents) - len(kept)
        if self.cfg.append_eod:
            for ids in kept:
                ids.append(self.tokenizer.eod)
        sizes = np.fromiter(map(len, kept), dtype=np.int64, count=len(kept))
        return np.fromiter(chain.from_iterable(kept), dtype=self.dtype, count=int(sizes.sum())), sizes


# The encoder a forked worker inherited (set once per worker by the pool's initializer).
_worker_encoder: ChunkEncoder | None = None


def _die_with_parent(parent: int) -> None:
    """Linux: SIGKILL this worker when the main process dies, even by SIGKILL (out of memory): an
    orphaned worker would wait for tasks forever."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return  # not Linux: the main process dying is then not covered
    if os.getppid() != parent:  # it died before the request took effect
        os._exit(1)


def _init_worker(encoder: ChunkEncoder, parent: int) -> None:
    global _worker_encoder
    _die_with_parent(parent)
    # Ctrl-C reaches the whole process group: only the main process reports and cleans up. A
    # worker that gets SIGTERM dies at once; the main process then reports the broken pool.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _worker_encoder = encoder


def _encode_in_worker(chunk) -> EncodedChunk:
    return _worker_encoder(chunk)


@contextmanager
def worker_pool(cfg: PreprocessConfig, encoder: ChunkEncoder):
    """A pool of forked workers that already hold the tokenizer, or None for --workers 1.

    fork, not spawn: a spawned worker would re-import and reload the vocabulary (~0.3 s each).
    ProcessPoolExecutor, not multiprocessing.Pool: Pool replaces a worker that dies and leaves its
    task unanswered forever; the executor fails every pending future with BrokenProcessPool.
    """
    if cfg.workers == 1 or "fork" not in multiprocessing.get_all_start_methods():
        yield None
        return
    pool = ProcessPoolExecutor(cfg.workers, mp_context=multiprocessing.get_context("fork"),
                               initializer=_init_worker, initargs=(encoder, os.getpid()))
    try:
        # The first task forks every worker, before any output file is open or progress thread runs.
        pool.submit(int).result()
        yield pool
    finally:
        # After an error: drop the queued chunks; running ones finish (a chunk's time) and workers exit.
        pool.shutdown(wait=True, cancel_futures=True)


def encoded_chunks(cfg: PreprocessConfig, encoder: ChunkEncoder, pool):
    """EncodedChunk per input chunk, in input order; a few chunks stay in flight per worker."""
    if pool is None:
        yield from map(encoder, read_chunks(cfg.input, cfg.chunk_bytes))
        return
    pending = deque()
    try:
        for chunk in read_chunks(cfg.input, cfg.chunk_bytes):
            pending.append(pool.submit(_encode_in_worker, chunk))
            if len(pending) > 2 * cfg.workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    except BrokenProcessPool:
        raise PreprocessError(
            "a tokenizer worker process died abruptly (killed by a signal, e.g. the out-of-memory killer); "
            f"stopped without writing --output-prefix {cfg.output_prefix}") from None


@dataclass
class Totals:
    documents: int = 0  # records read
    empty: int = 0  # documents left out because they have no tokens
    tokens: int = 0
    num_bytes: int = 0
    bad_lines: list[str] = field(default_factory=list)
    max_ids: dict[str, int] = field(default_factory=dict)  # per key; -1 while no token was seen


def output_prefix(cfg: PreprocessConfig, key: str) -> str:
    return f"{cfg.output_prefix}_{key}_document"


def check_output_folder(prefix: str) -> None:
    """Create the output folder and prove a file can be made in it, before any work: permissions
    alone do not tell (root writes anywhere, except on a read-only filesystem)."""
    folder = Path(prefix).parent
    if folder.exists() and not folder.is_dir():
        raise PreprocessError(f"--output-prefix {prefix}: {folder} is a file, not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise PreprocessError(f"--output-prefix {prefix}: cannot write to {folder} ({err.strerror or err})") from None


def run(cfg: PreprocessConfig) -> Totals:
    check_output_folder(cfg.output_prefix)
    source = source_record(cfg.input)  # as read: a file changed later makes the data stale
    tokenizer = build_tokenizer(cfg, verbose=False)
    dtype = best_fitting_dtype(tokenizer.vocab_size)
    encoder = ChunkEncoder(tokenizer, cfg, dtype)
    # The pool forks before any output file is open or any progress thread runs.
    with worker_pool(cfg, encoder) as pool:
        builders = {key: MMapIndexedDatasetBuilder(data_file_path(output_prefix(cfg, key)), dtype)
                    for key in cfg.json_keys}
        try:
            totals = write_chunks(cfg, encoded_chunks(cfg, encoder, pool), builders)
            for key, builder in builders.items():
                # No sidecar from an earlier build may describe the new pair, even for a moment.
                Path(sidecar_path(output_prefix(cfg, key))).unlink(missing_ok=True)
                builder.finalize(index_file_path(output_prefix(cfg, key)))
        except BaseException:
            for builder in builders.values():
                builder.discard()
            raise
    described = tokenizer_record(cfg, tokenizer.vocab_size)
    for key in cfg.json_keys:
        write_sidecar(output_prefix(cfg, key), totals.max_ids[key], source, described)
    return totals


def write_chunks(cfg: PreprocessConfig, chunks, builders) -> Totals:
    totals, progress = Totals(max_ids=dict.fromkeys(cfg.json_keys, -1)), Progress(cfg)
    try:
        for chunk in chunks:
            if chunk.bad_lines and not cfg.skip_bad_lines:
                raise PreprocessError(chunk.bad_lines[0])
            for key, (flat, sizes) in chunk.arrays.items():
                builders[key].add_documents(flat, sizes)
                totals.tokens += int(sizes.sum())
                if flat.size:
                    totals.max_ids[key] = max(totals.max_ids[key], int(flat.max()))
            totals.documents += chunk.records
            totals.empty += chunk.empty
            totals.num_bytes += chunk.num_bytes
            totals.bad_lines += chunk.bad_lines
            progress.show(totals)
    finally:
        progress.close()
    if totals.documents == 0:
        raise PreprocessError(f"{cfg.input}: no documents ({len(totals.bad_lines)} bad lines skipped)")
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
        prefix = output_prefix(cfg, key)
        print(f"wrote {data_file_path(prefix)}, {index_file_path(prefix)} and {sidecar_path(prefix)}")
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
    group.add_argument("--tokenizer-model",
                       help="SentencePiece model (SentencePieceTokenizer, Llama2Tokenizer) or Llama-3's tiktoken "
                            "tokenizer.model (Llama3Tokenizer); a local file")
    group.add_argument("--vocab-size", type=int, help="vocabulary size for NullTokenizer")
    group.add_argument("--append-eod", action="store_true", help="end every document with the eod token")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True, help="writes PREFIX_{key}_document.bin/.idx")
    group.add_argument("--dataset-impl", default="mmap", choices=["mmap"],
                       help="accepted for Megatron scripts; mmap is the only format")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizer processes")
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
        with stop_on_signals():
            totals = run(cfg)
    except ZeroLabError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except Stopped as stop:
        print(f"error: stopped by {stop}; no output written", file=sys.stderr)
        return 128 + stop.signum
    report(cfg, totals, time.perf_counter() - start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
