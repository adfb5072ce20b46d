"""GPT dataset: sample index (C++) against a Python reference, splits, epochs, index
caching, blending, determinism and bad input, on real indexed datasets written to disk."""
import glob
import os

import numpy as np
import pytest

from megatron.data import helpers
from megatron.data.blendable_dataset import BlendableDataset
from megatron.data.dataset_utils import DatasetError, parse_splits, split_boundaries
from megatron.data.gpt_dataset import build_train_valid_test_datasets, train_samples_per_epoch
from megatron.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder

DOC_STRIDE = 1000  # token = doc * DOC_STRIDE + position: every token names its document and place


def write_corpus(prefix, sizes, base=0):
    """A real PREFIX.bin/.idx whose document d holds tokens (base + d) * DOC_STRIDE + [0, size)."""
    builder = MMapIndexedDatasetBuilder(f"{prefix}.bin", np.int32)
    for doc, size in enumerate(sizes):
        builder.add_item(np.arange(size, dtype=np.int64) + (base + doc) * DOC_STRIDE)
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


@pytest.fixture
def corpus(tmp_path):
    sizes = np.random.default_rng(7).integers(1, 60, size=40)
    return write_corpus(tmp_path / "corpus", sizes), sizes


def reference_sample_idx(sizes, doc_idx, seq_length, num_samples):
    """Straightforward walk: sample k starts at token k * seq_length of the document stream."""
    starts = []
    position, offset = 0, 0
    for sample in range(num_samples + 1):
        target = sample * seq_length
        consumed_before = sum(sizes[d] for d in doc_idx[:position])
        while consumed_before + sizes[doc_idx[position]] <= target:
            consumed_before += sizes[doc_idx[position]]
            position += 1
        offset = target - consumed_before
        starts.append((position, offset))
    return np.array(starts, dtype=np.int64)


def document_stream(indexed, doc_idx):
    return np.concatenate([np.asarray(indexed.get(int(d)), dtype=np.int64) for d in doc_idx])


@pytest.mark.parametrize("seq_length,num_epochs", [(1, 1), (5, 1), (16, 2), (37, 3), (200, 4)])
def test_cpp_sample_idx_matches_python_reference(seq_length, num_epochs):
    rng = np.random.default_rng(seq_length)
    sizes = rng.integers(0, 30, size=25)  # zero-length documents included
    sizes[3] = 0
    doc_idx = np.concatenate([rng.permutation(25) for _ in range(num_epochs)])
    tokens_per_epoch = int(sizes.sum())
    got = helpers.build_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch)
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    assert got.shape == (num_samples + 1, 2)
    np.testing.assert_array_equal(got, reference_sample_idx(sizes, doc_idx, seq_length, num_samples))


def test_cpp_sample_idx_rejects_short_doc_idx():
    with pytest.raises(RuntimeError, match="fewer tokens"):
        helpers.build_sample_idx(np.array([10, 10]), np.array([0]), 4, 1, 20)


def test_samples_are_the_shuffled_document_stream(corpus):
    prefix, sizes = corpus
    seq_length = 16
    train, valid, test = build_train_valid_test_datasets([prefix], "100,0,0", (50, 0, 0), seq_length, 1234)
    assert valid is None and test is None
    indexed = MMapIndexedDataset(prefix)
    stream = document_stream(indexed, train.doc_idx)
    assert len(train) == (len(stream) - 1) // seq_length >= 50
    for i in range(len(train)):
        sample_id = int(train.shuffle_idx[i])
        text = train[i]["text"]
        assert text.dtype == np.int64 and text.shape == (seq_length + 1,)
        np.testing.assert_array_equal(text, stream[sample_id * seq_length: (sample_id + 1) * seq_length + 1])
    # In stream order, consecutive samples overlap by exactly one token.
    order = np.argsort(np.asarray(train.shuffle_idx))
    for a, b in zip(order[:-1], order[1:]):
        assert train[int(a)]["text"][-1] == train[int(b)]["text"][0]
    assert sorted(train.doc_idx.tolist()) == list(range(len(sizes)))


def test_split_is_by_documents(corpus):
    prefix, sizes = corpus
    bounds = split_boundaries(parse_splits("6,2,2"), len(sizes))
    assert bounds == [0, 24, 32, 40]
    datasets = build_train_valid_test_datasets([prefix], "6,2,2", (20, 5, 5), 8, 1)
    for split, dataset in enumerate(datasets):
        assert sorted(set(dataset.doc_idx.tolist())) == list(range(bounds[split], bounds[split + 1]))
        docs_seen = {int(t) // DOC_STRIDE for i in range(len(dataset)) for t in dataset[i]["text"]}
        assert docs_seen <= set(range(bounds[split], bounds[split + 1]))
    assert train_samples_per_epoch([prefix], "6,2,2", 8) == (int(sizes[:24].sum()) - 1) // 8


def test_several_epochs_repeat_each_document_once_per_epoch(corpus):
    prefix, sizes = corpus
    per_epoch = (int(sizes.sum()) - 1) // 10
    wanted = per_epoch * 2 + per_epoch // 2  # two full epochs and half of a third
    train, _, _ = build_train_valid_test_datasets([prefix], "1", (wanted, 0, 0), 10, 5)
    assert len(train) >= wanted
    doc_idx = np.asarray(train.doc_idx).reshape(3, len(sizes))
    for epoch in doc_idx:
        assert sorted(epoch.tolist()) == list(range(len(sizes)))
    assert not np.array_equal(doc_idx[0], doc_idx[1])  # a fresh shuffle per epoch
    # The half-used last epoch is kept apart: the first two epochs' samples come first.
    from_full_epochs = (2 * int(sizes.sum()) - 1) // 10
    head = np.asarray(train.shuffle_idx[:from_full_epochs])
    assert sorted(head.tolist()) == list(range(from_full_epochs))


def test_index_cache_written_once_then_reused(corpus):
    prefix, _ = corpus
    folder = os.path.dirname(prefix)
    build_train_valid_test_datasets([prefix], "100,0,0", (30, 0, 0), 8, 42)
    files = sorted(glob.glob(os.path.join(folder, "corpus_train_indexmap_*.npy")))
    assert [f.rsplit("_", 2)[-2:] for f in files] == [["doc", "idx.npy"], ["sample", "idx.npy"], ["shuffle", "idx.npy"]]
    stamps = {f: os.stat(f).st_mtime_ns for f in files}
    assert not glob.glob(os.path.join(folder, "*.tmp-*"))

    again, _, _ = build_train_valid_test_datasets([prefix], "100,0,0", (30, 0, 0), 8, 42)
    assert {f: os.stat(f).st_mtime_ns for f in files} == stamps  # loaded, not rebuilt
    assert isinstance(again.sample_idx, np.memmap)

    build_train_valid_test_datasets([prefix], "100,0,0", (30, 0, 0), 8, 43)  # new seed, new key
    assert len(glob.glob(os.path.join(folder, "corpus_train_indexmap_*.npy"))) == 6
    build_train_valid_test_datasets([prefix], "100,0,0", (30, 0, 0), 9, 42)  # new seq length, new key
    assert len(glob.glob(os.path.join(folder, "corpus_train_indexmap_*.npy"))) == 9


def test_incomplete_cache_is_rebuilt(corpus):
    prefix, _ = corpus
    first, _, _ = build_train_valid_test_datasets([prefix], "1", (30, 0, 0), 8, 3)
    expected = [first[i]["text"].copy() for i in range(len(first))]
    shuffle_file = glob.glob(os.path.dirname(prefix) + "/corpus_train_indexmap_*_shuffle_idx.npy")[0]
    os.remove(shuffle_file)  # as if the builder died before its last write
    rebuilt, _, _ = build_train_valid_test_datasets([prefix], "1", (30, 0, 0), 8, 3)
    assert os.path.isfile(shuffle_file)
    for i, text in enumerate(expected):
        np.testing.assert_array_equal(rebuilt[i]["text"], text)


def test_regenerated_data_gets_a_new_cache_key(tmp_path):
    sizes = np.arange(5, 45)
    prefix = write_corpus(tmp_path / "corpus", sizes)
    build_train_valid_test_datasets([prefix], "1", (20, 0, 0), 8, 1)
    write_corpus(tmp_path / "corpus", sizes[::-1])  # same documents and tokens, other sizes
    again, _, _ = build_train_valid_test_datasets([prefix], "1", (20, 0, 0), 8, 1)
    assert len(glob.glob(str(tmp_path / "corpus_train_indexmap_*.npy"))) == 6
    stream = document_stream(MMapIndexedDataset(prefix), again.doc_idx)
    sample_id = int(again.shuffle_idx[0])
    np.testing.assert_array_equal(again[0]["text"], stream[sample_id * 8: sample_id * 8 + 9])


def test_unwritable_cache_names_the_file(corpus):
    prefix, _ = corpus
    build_train_valid_test_datasets([prefix], "1", (20, 0, 0), 8, 1)
    files = sorted(glob.glob(prefix + "_train_indexmap_*.npy"))
    for path in files:
        os.remove(path)
    os.mkdir(files[1])  # the sample_idx cache path is taken by a folder
    with pytest.raises(DatasetError, match=r"--data-path .*corpus: cannot write index cache .*_sample_idx\.npy"):
        build_train_valid_test_datasets([prefix], "1", (20, 0, 0), 8, 1)
    assert not glob.glob(prefix + "*.tmp-*")


def test_same_seed_same_samples_other_seed_other_order(tmp_path):
    sizes = np.random.default_rng(1).integers(5, 50, size=30)
    prefixes = [write_corpus(tmp_path / name, sizes) for name in ("a", "b")]  # separate caches

    def samples(prefix, seed):
        train, _, _ = build_train_valid_test_datasets([prefix], "1", (40, 0, 0), 12, seed)
        return np.stack([train[i]["text"] for i in range(40)])

    np.testing.assert_array_equal(samples(prefixes[0], 9), samples(prefixes[1], 9))
    other = samples(prefixes[0], 10)
    assert not np.array_equal(samples(prefixes[0], 9), other)


def test_blending_follows_the_weights(tmp_path):
    sizes = np.full(40, 30)
    a = write_corpus(tmp_path / "a", sizes, base=0)
    b = write_corpus(tmp_path / "b", sizes, base=100)  # documents 100.. mark dataset b
    size = 400
    train, valid, _ = build_train_valid_test_datasets(["0.3", a, "0.7", b], "9,1,0", (size, 20, 0), 8, 11)
    assert len(train) == size and len(valid) == 20
    from_b = np.array([train[i]["text"][0] // DOC_STRIDE >= 100 for i in range(size)])
    assert from_b.mean() == pytest.approx(0.7, abs=0.005)
    for end in (10, 50, 123, size):  # every prefix of the order is close to the weights
        assert abs(from_b[:end].sum() - 0.7 * end) <= 1.0
    # Each blended part was built with Megatron's 0.5% margin over its share.
    assert train.datasets[0].spec.num_samples == int(np.ceil(size * 0.3 * 1.005))
    assert train.datasets[1].spec.num_samples == int(np.ceil(size * 0.7 * 1.005))


def test_blend_larger_than_a_dataset_is_refused(corpus):
    prefix, _ = corpus
    train, _, _ = build_train_valid_test_datasets([prefix], "1", (10, 0, 0), 8, 1)
    with pytest.raises(DatasetError, match=rf"blended dataset 1 has {len(train)} samples but the blend needs"):
        BlendableDataset([train, train], [0.1, 0.9], 2 * len(train))


def test_blending_indices_greedy_order():
    which, sample = helpers.build_blending_indices(np.array([0.5, 0.25, 0.25]), 8)
    assert which.tolist() == [0, 1, 2, 0, 0, 1, 2, 0]
    assert sample.tolist() == [0, 0, 0, 1, 2, 1, 1, 3]


@pytest.mark.parametrize("data_path,split,message", [
    (["{missing}"], "1", r"--data-path .*nothere: .*nothere\.bin not found"),
    (["{prefix}"], "9,x,1", r"--split '9,x,1': expected numbers"),
    (["{prefix}"], "1,1,1,1", r"--split '1,1,1,1': expected at most 3"),
    (["{prefix}"], "0,0,0", r"--split '0,0,0': the entries sum to 0"),
    (["{prefix}"], "5,-1,1", r"--split '5,-1,1': entries must be non-negative"),
    (["0.5", "{prefix}", "{prefix}"], "1", r"--data-path has 3 entries"),
    (["half", "{prefix}", "0.5", "{prefix}"], "1", r"--data-path weight 'half' .* is not a number"),
    (["0", "{prefix}", "1", "{prefix}"], "1", r"--data-path weight '0' .* must be a positive number"),
])
def test_bad_data_path_and_split(corpus, tmp_path, data_path, split, message):
    prefix, _ = corpus
    paths = [p.format(prefix=prefix, missing=tmp_path / "nothere") for p in data_path]
    with pytest.raises(DatasetError, match=message):
        build_train_valid_test_datasets(paths, split, (10, 0, 0), 8, 1)


def test_empty_split_with_samples_requested(corpus):
    prefix, _ = corpus
    with pytest.raises(DatasetError, match=r"the valid split of --split gets 0 of 40 documents but 5 valid samples"):
        build_train_valid_test_datasets([prefix], "100,0,0", (10, 5, 0), 8, 1)


def test_seq_length_longer_than_the_data(corpus, tmp_path):
    prefix, sizes = corpus
    tokens = int(sizes.sum())
    with pytest.raises(DatasetError, match=rf"train split has {tokens} tokens .* --seq-length {tokens}"):
        build_train_valid_test_datasets([prefix], "1", (1, 0, 0), tokens, 1)
    with pytest.raises(DatasetError, match=r"--seq-length 0"):
        train_samples_per_epoch([prefix], "1", 0)


def test_truncated_index_names_the_file(corpus):
    prefix, _ = corpus
    with open(prefix + ".idx", "r+b") as index:
        index.truncate(30)
    with pytest.raises(DatasetError, match=r"--data-path .*corpus: .*corpus\.idx: truncated"):
        build_train_valid_test_datasets([prefix], "1", (10, 0, 0), 8, 1)


def test_dolly_dataset_end_to_end(dolly_data_dir):
    """The real prepared dolly corpus: Megatron's default split, GPT-2 ids, documents joined at eod."""
    prefix = str(dolly_data_dir / "dolly_text_document")
    indexed = MMapIndexedDataset(prefix)
    bounds = split_boundaries(parse_splits("949,50,1"), len(indexed))
    train_tokens = int(np.asarray(indexed.sizes[: bounds[1]], dtype=np.int64).sum())
    assert train_samples_per_epoch([prefix], "949,50,1", 128) == (train_tokens - 1) // 128
    train, valid, test = build_train_valid_test_datasets([prefix], "949,50,1", (300, 16, 0), 128, 1234)
    assert test is None and len(valid) >= 16
    texts = np.stack([train[i]["text"] for i in range(300)])
    assert texts.shape == (300, 129) and texts.min() >= 0 and texts.max() <= 50256
    assert (texts == 50256).any(axis=1).mean() > 0.2  # samples run across document ends
    assert sorted(set(np.asarray(valid.doc_idx).tolist())) == list(range(bounds[1], bounds[2]))
