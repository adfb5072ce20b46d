"""The mmap indexed dataset: byte layout (checked by an independent reader), round trips,
dtype choice, merging, and a named error for every kind of corrupt file."""
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO_ROOT
from conftest import test_env as subprocess_env
from megatron.data.indexed_dataset import (
    IndexedDatasetError,
    MMapIndexedDataset,
    MMapIndexedDatasetBuilder,
    best_fitting_dtype,
    data_file_path,
    index_file_path,
)

DOCS = [[[5, 6, 7]], [[1], [2, 3]], [[65000, 0, 9, 9]]]  # documents -> sequences -> ids


def build(prefix, docs=DOCS, dtype=np.uint16):
    builder = MMapIndexedDatasetBuilder(data_file_path(prefix), dtype=dtype)
    for doc in docs:
        for sequence in doc:
            builder.add_item(np.array(sequence))
        builder.end_document()
    builder.finalize(index_file_path(prefix))
    return str(prefix)


def read_idx(path):
    """Independent reader of the Megatron .idx layout."""
    raw = open(path, "rb").read()
    magic, version, code, n, d = struct.unpack_from("<9sQBQQ", raw, 0)
    offset = 34
    sizes = np.frombuffer(raw, "<i4", n, offset)
    pointers = np.frombuffer(raw, "<i8", n, offset + 4 * n)
    doc_idx = np.frombuffer(raw, "<i8", d, offset + 12 * n)
    assert len(raw) == offset + 12 * n + 8 * d
    return magic, version, code, sizes, pointers, doc_idx


def write_idx(path, sizes, pointers, doc_idx, magic=b"MMIDIDX\x00\x00", version=1, code=8):
    header = struct.pack("<9sQBQQ", magic, version, code, len(sizes), len(doc_idx))
    body = np.asarray(sizes, "<i4").tobytes() + np.asarray(pointers, "<i8").tobytes() + np.asarray(doc_idx, "<i8").tobytes()
    open(path, "wb").write(header + body)


def test_idx_and_bin_bytes_field_by_field(tmp_path):
    prefix = build(tmp_path / "ds")
    magic, version, code, sizes, pointers, doc_idx = read_idx(index_file_path(prefix))
    assert magic == b"MMIDIDX\x00\x00" and version == 1 and code == 8  # 8 = uint16
    assert sizes.tolist() == [3, 1, 2, 4]
    assert pointers.tolist() == [0, 6, 8, 12]  # byte offsets: 2 bytes per uint16 token
    assert doc_idx.tolist() == [0, 1, 3, 4]
    flat = [i for doc in DOCS for seq in doc for i in seq]
    assert open(data_file_path(prefix), "rb").read() == np.array(flat, "<u2").tobytes()


def test_round_trip_of_every_document_with_zero_copy_views(tmp_path):
    rng = np.random.default_rng(0)
    docs = [[rng.integers(0, 100_000, rng.integers(1, 50)).tolist()] for _ in range(200)]
    prefix = build(tmp_path / "big", docs, dtype=best_fitting_dtype(100_000))
    ds = MMapIndexedDataset(prefix)
    assert len(ds) == 200 and ds.dtype == np.int32
    assert ds.sizes.dtype == np.int32 and ds.doc_idx.dtype == np.int64 and ds.pointers.dtype == np.int64
    for i, doc in enumerate(docs):
        assert ds[i].tolist() == doc[0]
    view = ds[7]
    assert not view.flags.owndata and not view.flags.writeable
    assert ds.get(7, offset=1, length=2).tolist() == docs[7][0][1:3]
    assert ds[-1].tolist() == docs[-1][0]
    assert [a.tolist() for a in ds[2:4]] == [docs[2][0], docs[3][0]]
    with pytest.raises(IndexError, match="out of range"):
        ds[200]
    with pytest.raises(IndexError, match="out of range"):
        ds.get(0, offset=0, length=len(docs[0][0]) + 1)


def test_best_fitting_dtype():
    assert best_fitting_dtype(50257) == np.uint16
    assert best_fitting_dtype(65499) == np.uint16
    assert best_fitting_dtype(65500) == np.int32
    assert best_fitting_dtype(None) == np.int32


def test_add_document_and_bulk_add_documents(tmp_path):
    builder = MMapIndexedDatasetBuilder(data_file_path(tmp_path / "d"), dtype=np.uint16)
    builder.add_document([1, 2, 3, 4], lengths=[1, 3])
    builder.add_documents(np.array([7, 8, 9]), sizes=[2, 1])
    builder.finalize(index_file_path(tmp_path / "d"))
    ds = MMapIndexedDataset(tmp_path / "d")
    assert [ds[i].tolist() for i in range(len(ds))] == [[1], [2, 3, 4], [7, 8], [9]]
    assert ds.doc_idx.tolist() == [0, 2, 3, 4]


def test_builder_rejects_bad_items_and_leaves_nothing_until_finalize(tmp_path):
    builder = MMapIndexedDatasetBuilder(data_file_path(tmp_path / "d"), dtype=np.uint16)
    with pytest.raises(IndexedDatasetError, match="do not fit dtype uint16"):
        builder.add_item([70000])
    with pytest.raises(IndexedDatasetError, match="lengths sum to 2 but 3 ids"):
        builder.add_document([1, 2, 3], lengths=[1, 1])
    builder.add_item([1, 2])
    assert not (tmp_path / "d.bin").exists() and not (tmp_path / "d.idx").exists()
    builder.discard()
    assert list(tmp_path.iterdir()) == []


def test_merge_keeps_documents_and_boundaries(tmp_path):
    first = build(tmp_path / "a")
    second = build(tmp_path / "b", [[[4, 4]], [[3]]])
    builder = MMapIndexedDatasetBuilder(data_file_path(tmp_path / "m"), dtype=np.uint16)
    builder.merge_file_(first)
    builder.merge_file_(second)
    builder.finalize(index_file_path(tmp_path / "m"))
    merged = MMapIndexedDataset(tmp_path / "m")
    assert [merged[i].tolist() for i in range(len(merged))] == [[5, 6, 7], [1], [2, 3], [65000, 0, 9, 9], [4, 4], [3]]
    assert merged.doc_idx.tolist() == [0, 1, 3, 4, 5, 6]
    assert read_idx(index_file_path(tmp_path / "m"))[4].tolist() == [0, 6, 8, 12, 20, 24]


def test_merge_rejects_a_different_dtype(tmp_path):
    build(tmp_path / "a")
    builder = MMapIndexedDatasetBuilder(data_file_path(tmp_path / "m"), dtype=np.int32)
    with pytest.raises(IndexedDatasetError, match=r"a\.idx: dtype uint16 differs"):
        builder.merge_file_(tmp_path / "a")
    builder.discard()


def run_merge(*args):
    return subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "merge_datasets.py"), *map(str, args)],
                          env=subprocess_env(), capture_output=True, text=True, timeout=60)


def test_merge_datasets_tool_with_a_directory_and_a_prefix(tmp_path):
    (tmp_path / "parts").mkdir()
    build(tmp_path / "parts" / "p1", [[[1, 2]]])
    build(tmp_path / "parts" / "p0", [[[3]]])
    build(tmp_path / "extra", [[[9, 9, 9]]])
    result = run_merge("--input", tmp_path / "parts", tmp_path / "extra", "--output-prefix", tmp_path / "all")
    assert result.returncode == 0, result.stderr
    assert "merged 3 datasets" in result.stdout and "3 documents, 6 tokens" in result.stdout
    merged = MMapIndexedDataset(tmp_path / "all")
    assert [merged[i].tolist() for i in range(3)] == [[3], [1, 2], [9, 9, 9]]  # directory entries sorted


def test_merge_datasets_tool_errors(tmp_path):
    result = run_merge("--input", tmp_path / "nothing", "--output-prefix", tmp_path / "out")
    assert result.returncode == 1
    assert result.stderr.startswith("error: --input ") and "nothing" in result.stderr
    build(tmp_path / "a")
    build(tmp_path / "b", dtype=np.int32)
    result = run_merge("--input", tmp_path / "a", tmp_path / "b", "--output-prefix", tmp_path / "out")
    assert result.returncode == 1 and "dtype int32 differs" in result.stderr and "Traceback" not in result.stderr
    assert not list(tmp_path.glob("out*"))


def corrupt_bin_truncated(prefix):
    raw = open(data_file_path(prefix), "rb").read()
    open(data_file_path(prefix), "wb").write(raw[:-2])


def corrupt_bin_odd_size(prefix):
    open(data_file_path(prefix), "ab").write(b"\x00")


def corrupt_idx_truncated(prefix):
    raw = open(index_file_path(prefix), "rb").read()
    open(index_file_path(prefix), "wb").write(raw[:-3])


def corrupt_idx_empty(prefix):
    open(index_file_path(prefix), "wb").close()


def corrupt_idx_field(**fields):
    def corrupt(prefix):
        good = dict(sizes=[3, 1, 2, 4], pointers=[0, 6, 8, 12], doc_idx=[0, 1, 3, 4])
        write_idx(index_file_path(prefix), **{**good, **fields})
    return corrupt


def remove(path_of):
    return lambda prefix: os.remove(path_of(prefix))


CORRUPTIONS = {
    "truncated bin": (corrupt_bin_truncated, r"ds\.bin: sequence 3 ends at byte 20 but the data file has 18 bytes"),
    "bin not whole items": (corrupt_bin_odd_size, r"ds\.bin: size 21 is not a multiple"),
    "truncated idx": (corrupt_idx_truncated, r"ds\.idx: index is \d+ bytes .*\(truncated\)"),
    "empty idx": (corrupt_idx_empty, r"ds\.idx: truncated index: 0 bytes"),
    "wrong magic": (corrupt_idx_field(magic=b"TNTIDX\x00\x00\x00"), r"ds\.idx: not a Megatron mmap index"),
    "wrong version": (corrupt_idx_field(version=2), r"ds\.idx: unsupported index version 2"),
    "wrong dtype code": (corrupt_idx_field(code=9), r"ds\.idx: unknown dtype code 9"),
    "pointer past end": (corrupt_idx_field(pointers=[0, 6, 8, 40]), r"ds\.bin: sequence 3 ends at byte 48"),
    "size past end": (corrupt_idx_field(sizes=[3, 1, 2, 400]), r"ds\.bin: sequence 3 ends at byte 812"),
    "negative size": (corrupt_idx_field(sizes=[3, -1, 2, 4]), r"ds\.idx: negative sequence size at index 1"),
    "misaligned pointer": (corrupt_idx_field(pointers=[0, 5, 8, 12]), r"ds\.idx: pointer 5 of sequence 1"),
    "doc_idx not monotone": (corrupt_idx_field(doc_idx=[0, 3, 1, 4]), r"ds\.idx: document index decreases at entry 2"),
    "doc_idx not ending at N": (corrupt_idx_field(doc_idx=[0, 1, 3]), r"ds\.idx: document index ends at 3, expected .* 4"),
    "doc_idx not starting at 0": (corrupt_idx_field(doc_idx=[1, 3, 4]), r"ds\.idx: document index must start with 0"),
    "missing idx": (remove(index_file_path), r"ds\.idx: index file not found"),
    "missing bin": (remove(data_file_path), r"ds\.bin: data file not found"),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_every_corrupt_file_gets_a_named_error(tmp_path, case):
    corrupt, message = CORRUPTIONS[case]
    prefix = build(tmp_path / "ds")
    MMapIndexedDataset(prefix)  # intact before the damage
    corrupt(prefix)
    with pytest.raises(IndexedDatasetError, match=message):
        MMapIndexedDataset(prefix)
