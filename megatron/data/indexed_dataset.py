"""Megatron's mmap indexed dataset: a `.bin` of concatenated token ids plus an `.idx` index.

Byte layout of `PREFIX.idx` (little-endian, identical to Megatron-DeepSpeed's MMapIndexedDataset):

    magic b"MMIDIDX\\x00\\x00" | version uint64 = 1 | dtype code uint8 | N uint64 | D uint64
    | sizes int32[N] | pointers int64[N] | doc_idx int64[D]

`sizes[i]` is the number of tokens of sequence i, `pointers[i]` its byte offset in `.bin`, and
`doc_idx` lists the sequence index at which each document starts (first 0, last N).

Reading is zero-copy: both files are memory-mapped and `ds[i]` is a numpy view into `.bin`.
Every header field and every offset is checked when a dataset is opened, so a truncated or
foreign file raises `IndexedDatasetError` naming the file instead of returning garbage.
This module imports neither torch nor the tokenizer, so data tools start fast.
"""
from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path

import numpy as np

from megatron.errors import ZeroLabError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
# Header: magic, version (uint64), dtype code (uint8), N (uint64), D (uint64).
_HEADER = struct.Struct("<9sQBQQ")

DTYPE_CODES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF_DTYPE = {np.dtype(dtype): code for code, dtype in DTYPE_CODES.items()}


class IndexedDatasetError(ZeroLabError, ValueError):
    """A `.bin`/`.idx` pair that is missing, truncated, foreign or inconsistent."""


def best_fitting_dtype(vocab_size: int | None) -> type:
    """The smallest token dtype Megatron uses for a vocabulary: uint16 below 65500 ids."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def data_file_path(prefix: str | os.PathLike) -> str:
    return str(prefix) + ".bin"


def index_file_path(prefix: str | os.PathLike) -> str:
    return str(prefix) + ".idx"


def dtype_code(dtype) -> int:
    try:
        return _CODE_OF_DTYPE[np.dtype(dtype)]
    except KeyError:
        raise IndexedDatasetError(
            f"dtype {np.dtype(dtype)} cannot be stored in an indexed dataset "
            f"(expected one of {sorted(str(np.dtype(d)) for d in DTYPE_CODES.values())})"
        ) from None


def _temp_path(path: str) -> str:
    return f"{path}.tmp-{os.getpid()}"


class MMapIndexedDatasetBuilder:
    """Writes a `.bin` incrementally and its `.idx` in `finalize`.

    Data goes to a temporary file next to `out_bin_path`; `finalize` writes the index under a
    temporary name too and renames both, so an interrupted build never leaves a pair of files
    that looks complete. Call `discard()` to remove the temporary file on failure.
    """

    def __init__(self, out_bin_path: str | os.PathLike, dtype=np.int64):
        self._dtype = np.dtype(dtype)
        self._code = dtype_code(self._dtype)
        self._bin_path = str(out_bin_path)
        self._tmp_bin_path = _temp_path(self._bin_path)
        self._file = open(self._tmp_bin_path, "wb")
        # Chunks of sizes/doc starts: appending whole arrays keeps bulk adds O(chunks).
        self._sizes: list[np.ndarray] = []
        self._doc_starts: list[np.ndarray] = [np.zeros(1, dtype=np.int64)]
        self._num_sequences = 0

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    def _write_tokens(self, ids) -> int:
        array = np.asarray(ids)
        if array.ndim != 1:
            array = array.reshape(-1)
        if array.size and array.dtype != self._dtype and self._dtype.kind in "iu":
            info = np.iinfo(self._dtype)
            if array.min() < info.min or array.max() > info.max:
                raise IndexedDatasetError(
                    f"{self._bin_path}: token ids {array.min()}..{array.max()} do not fit dtype {self._dtype}"
                )
        array = array.astype(self._dtype, copy=False)
        self._file.write(array.tobytes(order="C"))
        return array.size

    def add_item(self, ids) -> None:
        """Append one sequence (list, numpy array or CPU tensor of token ids)."""
        count = self._write_tokens(ids)
        self._sizes.append(np.array([count], dtype=np.int32))
        self._num_sequences += 1

    def end_document(self) -> None:
        """Close the current document: the sequences added since the last call form one."""
        self._doc_starts.append(np.array([self._num_sequences], dtype=np.int64))

    def add_document(self, ids, lengths) -> None:
        """Append one document made of `len(lengths)` sequences whose tokens are `ids`."""
        lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        count = self._write_tokens(ids)
        if int(lengths.sum()) != count:
            raise IndexedDatasetError(
                f"{self._bin_path}: document lengths sum to {int(lengths.sum())} but {count} ids were given"
            )
        self._sizes.append(lengths.astype(np.int32))
        self._num_sequences += lengths.size
        self.end_document()

    def add_documents(self, ids, sizes) -> None:
        """Append many one-sequence documents at once: `ids` concatenated, `sizes` per document."""
        sizes = np.asarray(sizes, dtype=np.int64).reshape(-1)
        count = self._write_tokens(ids)
        if int(sizes.sum()) != count:
            raise IndexedDatasetError(
                f"{self._bin_path}: document sizes sum to {int(sizes.sum())} but {count} ids were given"
            )
        starts = np.arange(1, sizes.size + 1, dtype=np.int64) + self._num_sequences
        self._sizes.append(sizes.astype(np.int32))
        self._doc_starts.append(starts)
        self._num_sequences += sizes.size

    def merge_file_(self, other_prefix: str | os.PathLike) -> None:
        """Append every document of the dataset at `other_prefix` (same dtype required)."""
        other = MMapIndexedDataset(other_prefix)
        if other.dtype != self._dtype:
            raise IndexedDatasetError(
                f"{index_file_path(other_prefix)}: dtype {other.dtype} differs from the builder's {self._dtype}"
            )
        self._sizes.append(np.array(other.sizes, dtype=np.int32))
        self._doc_starts.append(np.array(other.doc_idx[1:], dtype=np.int64) + self._num_sequences)
        self._num_sequences += len(other)
        del other  # release the memory maps before copying the file
        with open(data_file_path(other_prefix), "rb") as source:
            shutil.copyfileobj(source, self._file, length=16 << 20)

    def finalize(self, idx_path: str | os.PathLike) -> None:
        """Write the index to `idx_path` and move both files to their final names."""
        self._file.close()
        idx_path = str(idx_path)
        sizes = np.concatenate(self._sizes) if self._sizes else np.zeros(0, dtype=np.int32)
        doc_idx = np.concatenate(self._doc_starts)
        if doc_idx[-1] != sizes.size:
            # Sequences added after the last end_document() belong to an unterminated document.
            doc_idx = np.append(doc_idx, sizes.size)
        pointers = np.zeros(sizes.size, dtype=np.int64)
        np.cumsum(sizes[:-1], dtype=np.int64, out=pointers[1:])
        pointers *= self._dtype.itemsize
        tmp_idx_path = _temp_path(idx_path)
        with open(tmp_idx_path, "wb") as index:
            index.write(_HEADER.pack(MAGIC, VERSION, self._code, sizes.size, doc_idx.size))
            index.write(sizes.astype("<i4").tobytes())
            index.write(pointers.astype("<i8").tobytes())
            index.write(doc_idx.astype("<i8").tobytes())
        # A stale index must never sit beside the new data, even for a moment.
        Path(idx_path).unlink(missing_ok=True)
        os.replace(self._tmp_bin_path, self._bin_path)
        os.replace(tmp_idx_path, idx_path)

    def discard(self) -> None:
        """Drop everything written so far (used when the input turns out to be bad)."""
        self._file.close()
        Path(self._tmp_bin_path).unlink(missing_ok=True)


class MMapIndexedDataset:
    """Read-only view of `PREFIX.bin`/`PREFIX.idx`; `ds[i]` is a zero-copy numpy array."""

    def __init__(self, prefix: str | os.PathLike, skip_warmup: bool = True):
        # skip_warmup is accepted for Megatron call compatibility; pages load lazily anyway.
        self._prefix = str(prefix)
        self._idx_path = index_file_path(prefix)
        self._bin_path = data_file_path(prefix)
        self._read_index()
        self._map_data()
        self._check_offsets()

    @staticmethod
    def exists(prefix: str | os.PathLike) -> bool:
        return os.path.isfile(index_file_path(prefix)) and os.path.isfile(data_file_path(prefix))

    def _fail(self, path: str, what: str):
        raise IndexedDatasetError(f"{path}: {what}")

    def _read_index(self) -> None:
        path = self._idx_path
        if not os.path.isfile(path):
            self._fail(path, "index file not found (expected PREFIX.idx written by tools/preprocess_data.py)")
        file_size = os.path.getsize(path)
        if file_size < _HEADER.size:
            self._fail(path, f"truncated index: {file_size} bytes, header alone needs {_HEADER.size}")
        with open(path, "rb") as index:
            magic, version, code, count, doc_count = _HEADER.unpack(index.read(_HEADER.size))
        if magic != MAGIC:
            self._fail(path, f"not a Megatron mmap index (magic {magic!r}, expected {MAGIC!r})")
        if version != VERSION:
            self._fail(path, f"unsupported index version {version} (expected {VERSION})")
        if code not in DTYPE_CODES:
            self._fail(path, f"unknown dtype code {code} (expected one of {sorted(DTYPE_CODES)})")
        expected = _HEADER.size + count * 4 + count * 8 + doc_count * 8
        if file_size != expected:
            self._fail(
                path,
                f"index is {file_size} bytes but its header (N={count}, D={doc_count}) implies {expected}"
                + (" (truncated)" if file_size < expected else " (trailing bytes)"),
            )
        self._dtype = np.dtype(DTYPE_CODES[code])
        self._idx_map = np.memmap(path, mode="r", dtype=np.uint8)
        buffer = self._idx_map
        offset = _HEADER.size
        self._sizes = np.frombuffer(buffer, dtype="<i4", count=count, offset=offset)
        offset += count * 4
        self._pointers = np.frombuffer(buffer, dtype="<i8", count=count, offset=offset)
        offset += count * 8
        self._doc_idx = np.frombuffer(buffer, dtype="<i8", count=doc_count, offset=offset)
        self._check_doc_idx()

    def _check_doc_idx(self) -> None:
        doc_idx, count = self._doc_idx, len(self._sizes)
        if doc_idx.size == 0 or doc_idx[0] != 0:
            self._fail(self._idx_path, "document index must start with 0")
        if doc_idx[-1] != count:
            self._fail(self._idx_path, f"document index ends at {doc_idx[-1]}, expected the sequence count {count}")
        if doc_idx.size > 1 and np.any(np.diff(doc_idx) < 0):
            bad = int(np.argmax(np.diff(doc_idx) < 0))
            self._fail(self._idx_path, f"document index decreases at entry {bad + 1} ({doc_idx[bad]} -> {doc_idx[bad + 1]})")

    def _map_data(self) -> None:
        if not os.path.isfile(self._bin_path):
            self._fail(self._bin_path, "data file not found (expected beside its .idx)")
        size = os.path.getsize(self._bin_path)
        if size % self._dtype.itemsize:
            self._fail(self._bin_path, f"size {size} is not a multiple of the {self._dtype} item size (truncated?)")
        if size == 0:
            self._bin_map = None  # numpy cannot memory-map an empty file
            self._tokens = np.zeros(0, dtype=self._dtype)
        else:
            self._bin_map = np.memmap(self._bin_path, mode="r", dtype=np.uint8)
            self._tokens = np.frombuffer(self._bin_map, dtype=self._dtype.newbyteorder("<"))
        self._bin_size = size

    def _check_offsets(self) -> None:
        sizes, pointers, itemsize = self._sizes, self._pointers, self._dtype.itemsize
        if sizes.size == 0:
            return
        if np.any(sizes < 0):
            self._fail(self._idx_path, f"negative sequence size at index {int(np.argmax(sizes < 0))}")
        if np.any(pointers < 0) or np.any(pointers % itemsize):
            bad = int(np.argmax((pointers < 0) | (pointers % itemsize != 0)))
            self._fail(self._idx_path, f"pointer {pointers[bad]} of sequence {bad} is not a valid {self._dtype} offset")
        ends = pointers + sizes.astype(np.int64) * itemsize
        if np.any(ends > self._bin_size):
            bad = int(np.argmax(ends > self._bin_size))
            self._fail(
                self._bin_path,
                f"sequence {bad} ends at byte {ends[bad]} but the data file has {self._bin_size} bytes (truncated?)",
            )

    def __len__(self) -> int:
        return len(self._sizes)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self.get(i) for i in range(*index.indices(len(self)))]
        return self.get(index)

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens `offset:offset+length` of sequence `index`, as a view into `.bin`."""
        count = len(self)
        if not -count <= index < count:
            raise IndexError(f"sequence index {index} out of range for {self._prefix} ({count} sequences)")
        index %= count
        size = int(self._sizes[index])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens {offset}:{offset + length} out of range for sequence {index} of size {size}")
        start = int(self._pointers[index]) // self._dtype.itemsize + offset
        return self._tokens[start : start + length]

    @property
    def sizes(self) -> np.ndarray:
        return self._sizes

    @property
    def pointers(self) -> np.ndarray:
        return self._pointers

    @property
    def doc_idx(self) -> np.ndarray:
        return self._doc_idx

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def prefix(self) -> str:
        return self._prefix
