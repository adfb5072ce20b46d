"""GPT pretraining samples over a Megatron mmap indexed dataset.

A split's documents are repeated for as many epochs as the requested samples need, each
epoch in its own seeded shuffle (doc_idx). Their concatenation is cut into samples of
seq_length + 1 tokens that overlap by one token and run across document boundaries
(sample_idx, built in C++), and the samples are visited in a seeded shuffled order
(shuffle_idx). When the last epoch is used only in small part (< 80%), its samples are
shuffled separately and come last, so the earlier, complete epochs are seen in full first
(Megatron's separate_last_epoch). The three arrays are cached as .npy files next to the data, or in a
cache folder (--data-cache-path; a run's folder when the data's is read-only, megatron/startup.py).
"""
import hashlib
import json
import math
import os
import socket
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from megatron.data.blendable_dataset import BlendableDataset
from megatron.data.dataset_utils import (
    DatasetError,
    blended_num_samples,
    build_on_local_rank_zero,
    load_helpers,
    parse_data_path,
    parse_splits,
    split_boundaries,
)
from megatron.data.indexed_dataset import IndexedDatasetError, MMapIndexedDataset, data_file_path, index_file_path

SPLIT_NAMES = ("train", "valid", "test")
# Bump when the meaning of the cached arrays changes, so stale caches are not reused.
INDEX_FORMAT_VERSION = 1
# Megatron's rule: a last epoch with fewer than this share of an epoch's samples is kept apart.
SEPARATE_LAST_EPOCH_BELOW = 0.80

__all__ = ["DatasetError", "GPTDataset", "build_train_valid_test_datasets", "train_samples_per_epoch"]


@dataclass(frozen=True)
class SampleSpec:
    """Everything that determines one split's sample order (and so its cache key)."""

    name: str  # "train", "valid" or "test"
    prefix: str
    first_document: int
    end_document: int  # exclusive
    tokens_per_epoch: int
    sizes_digest: str  # of the split's document sizes: regenerated data never reuses a stale cache
    num_samples: int
    seq_length: int
    seed: int
    # where the index caches go (--data-cache-path, or a run's folder when the data's is read-only);
    # None: next to the data. Not part of the key: the same split gives the same arrays wherever cached.
    cache_dir: str | None = None

    @property
    def num_epochs(self) -> int:
        # Smallest e with (e * tokens_per_epoch - 1) // seq_length >= num_samples.
        return max(1, math.ceil((self.num_samples * self.seq_length + 1) / self.tokens_per_epoch))

    def cache_prefix(self) -> str:
        fields = dict(vars(self), prefix=os.path.realpath(self.prefix), version=INDEX_FORMAT_VERSION)
        del fields["cache_dir"]
        key = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
        base = self.prefix if self.cache_dir is None else os.path.join(self.cache_dir, os.path.basename(self.prefix))
        return f"{base}_{self.name}_indexmap_{key}"


def _log(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


def open_indexed_dataset(prefix: str) -> MMapIndexedDataset:
    """Open PREFIX.bin/.idx, with errors that name --data-path and the file."""
    for path in (data_file_path(prefix), index_file_path(prefix)):
        if not os.path.isfile(path):
            raise DatasetError(f"--data-path {prefix}: {path} not found")
    try:
        return MMapIndexedDataset(prefix)
    except IndexedDatasetError as exc:
        raise DatasetError(f"--data-path {prefix}: {exc}") from None


def build_doc_idx(documents: np.ndarray, num_epochs: int, rng: np.random.Generator) -> np.ndarray:
    """The documents once per epoch, each epoch in its own random order."""
    return np.concatenate([rng.permutation(documents) for _ in range(num_epochs)]).astype(np.int64)


def build_shuffle_idx(spec: SampleSpec, num_built: int, rng: np.random.Generator) -> np.ndarray:
    """A random order of the num_built samples, the last epoch's kept apart when it is small."""
    first_part = num_built
    if spec.num_epochs > 1:
        from_full_epochs = ((spec.num_epochs - 1) * spec.tokens_per_epoch - 1) // spec.seq_length
        per_epoch = (spec.tokens_per_epoch - 1) // spec.seq_length
        if spec.num_samples - from_full_epochs < int(SEPARATE_LAST_EPOCH_BELOW * per_epoch):
            first_part = from_full_epochs
    return np.concatenate([rng.permutation(first_part), first_part + rng.permutation(num_built - first_part)])


def build_index_arrays(spec: SampleSpec, sizes: np.ndarray) -> dict[str, np.ndarray]:
    """doc_idx, sample_idx and shuffle_idx for one split (see the module docstring)."""
    rng = np.random.default_rng(spec.seed)
    documents = np.arange(spec.first_document, spec.end_document, dtype=np.int64)
    doc_idx = build_doc_idx(documents, spec.num_epochs, rng)
    sample_idx = load_helpers().build_sample_idx(
        sizes, doc_idx, spec.seq_length, spec.num_epochs, spec.tokens_per_epoch)
    shuffle_idx = build_shuffle_idx(spec, sample_idx.shape[0] - 1, rng)
    return {"doc_idx": doc_idx, "sample_idx": sample_idx, "shuffle_idx": shuffle_idx}


def _save_atomically(path: str, array: np.ndarray) -> None:
    # Host and pid in the temporary name: builders on several nodes may share one filesystem.
    temp = f"{path}.tmp-{socket.gethostname()}-{os.getpid()}"
    try:
        with open(temp, "wb") as handle:
            np.save(handle, array, allow_pickle=False)
        os.replace(temp, path)
    finally:
        if os.path.exists(temp):
            os.remove(temp)


def load_or_build_index_arrays(spec: SampleSpec, sizes: np.ndarray) -> dict[str, np.ndarray]:
    """The split's cached index arrays, building and caching them first when missing."""
    base = spec.cache_prefix()
    paths = {name: f"{base}_{name}.npy" for name in ("doc_idx", "sample_idx", "shuffle_idx")}

    def build_if_missing() -> None:
        if all(os.path.isfile(path) for path in paths.values()):
            return
        _log(f" > building {spec.name} indices for {spec.prefix}: {spec.num_samples} samples of "
             f"{spec.seq_length} tokens, {spec.num_epochs} epoch(s)")
        # shuffle_idx is written last, so a crash mid-way leaves the cache visibly incomplete.
        for name, array in build_index_arrays(spec, sizes).items():
            try:
                _save_atomically(paths[name], array)
            except OSError as exc:
                raise DatasetError(f"--data-path {spec.prefix}: cannot write index cache {paths[name]} ({exc})") from None

    build_on_local_rank_zero(build_if_missing, f"the {spec.name} index of {spec.prefix}")
    try:
        return {name: np.load(path, mmap_mode="r", allow_pickle=False) for name, path in paths.items()}
    except (OSError, ValueError) as exc:
        raise DatasetError(f"--data-path {spec.prefix}: cannot read index cache {base}_*.npy ({exc})") from None


class GPTDataset(torch.utils.data.Dataset):
    """`ds[i]` is {"text": int64 array of seq_length + 1 tokens}, in shuffled sample order."""

    def __init__(self, indexed: MMapIndexedDataset, spec: SampleSpec):
        self.indexed = indexed
        self.spec = spec
        arrays = load_or_build_index_arrays(spec, indexed.sizes)
        self.doc_idx = arrays["doc_idx"]
        self.sample_idx = arrays["sample_idx"]
        self.shuffle_idx = arrays["shuffle_idx"]

    def __len__(self) -> int:
        return self.shuffle_idx.shape[0]

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range for the {self.spec.name} split ({len(self)} samples)")
        sample = int(self.shuffle_idx[index])
        first_pos, first_offset = (int(v) for v in self.sample_idx[sample])
        last_pos, last_offset = (int(v) for v in self.sample_idx[sample + 1])
        get = self.indexed.get
        if first_pos == last_pos:
            pieces = [get(int(self.doc_idx[first_pos]), offset=first_offset, length=last_offset - first_offset + 1)]
        else:
            pieces = [get(int(self.doc_idx[first_pos]), offset=first_offset)]
            pieces += [get(int(self.doc_idx[pos])) for pos in range(first_pos + 1, last_pos)]
            pieces.append(get(int(self.doc_idx[last_pos]), length=last_offset + 1))
        return {"text": np.concatenate(pieces).astype(np.int64)}


def _split_specs(prefix, indexed, fractions, num_samples, seq_length, seed,
                 cache_dir: str | None = None) -> list[SampleSpec | None]:
    """One SampleSpec per split (None where no samples are requested), validated."""
    bounds = split_boundaries(fractions, len(indexed))
    cumulative = np.concatenate([[0], np.cumsum(indexed.sizes, dtype=np.int64)])
    specs = []
    for split, name in enumerate(SPLIT_NAMES):
        first, end = bounds[split], bounds[split + 1]
        wanted = int(num_samples[split])
        if wanted == 0:
            specs.append(None)
            continue
        if end <= first:
            raise DatasetError(
                f"--data-path {prefix}: the {name} split of --split gets 0 of {len(indexed)} documents "
                f"but {wanted} {name} samples are requested")
        tokens = int(cumulative[end] - cumulative[first])
        digest = hashlib.sha256(np.ascontiguousarray(indexed.sizes[first:end]).tobytes()).hexdigest()[:16]
        if tokens <= seq_length:
            raise DatasetError(
                f"--data-path {prefix}: the {name} split has {tokens} tokens in {end - first} documents, "
                f"too few for one sample of --seq-length {seq_length} (+1 token)")
        specs.append(SampleSpec(name, prefix, first, end, tokens, digest, wanted, seq_length, seed, cache_dir))
    return specs


def _build_single(prefix, fractions, num_samples, seq_length, seed, cache_dir) -> list[GPTDataset | None]:
    indexed = open_indexed_dataset(prefix)
    specs = _split_specs(prefix, indexed, fractions, num_samples, seq_length, seed, cache_dir)
    return [None if spec is None else GPTDataset(indexed, spec) for spec in specs]


def _check_request(num_samples, seq_length) -> None:
    if int(seq_length) <= 0:
        raise DatasetError(f"--seq-length {seq_length}: expected a positive number of tokens")
    if len(num_samples) != 3 or any(int(n) < 0 for n in num_samples):
        raise DatasetError(f"train/valid/test sample counts {tuple(num_samples)}: expected three non-negative integers")


def build_train_valid_test_datasets(data_prefix: list[str], splits_string: str,
                                    train_valid_test_num_samples: tuple[int, int, int],
                                    seq_length: int, seed: int, cache_dir: str | None = None):
    """(train, valid, test) datasets for Megatron's --data-path/--split; a split with no
    samples requested is None. Collective when torch.distributed is initialized: every
    rank calls it, local rank 0 of each node builds the index caches (in cache_dir, else next
    to the data)."""
    _check_request(train_valid_test_num_samples, seq_length)
    pairs = parse_data_path(data_prefix)
    fractions = parse_splits(splits_string)
    if len(pairs) == 1:
        return tuple(_build_single(pairs[0][1], fractions, train_valid_test_num_samples, seq_length, seed, cache_dir))
    weights = [weight for weight, _ in pairs]
    per_prefix = blended_num_samples(weights, train_valid_test_num_samples)
    built = [_build_single(prefix, fractions, wanted, seq_length, seed, cache_dir)
             for (_, prefix), wanted in zip(pairs, per_prefix)]
    result = []
    for split, size in enumerate(train_valid_test_num_samples):
        parts = [datasets[split] for datasets in built]
        result.append(BlendableDataset(parts, weights, int(size)) if size else None)
    return tuple(result)


def train_samples_per_epoch(data_prefix: list[str], splits_string: str, seq_length: int) -> int:
    """Samples of seq_length + 1 tokens in one pass over the train split (summed over the
    blended datasets: one pass over all of their train data)."""
    _check_request((1, 0, 0), seq_length)
    fractions = parse_splits(splits_string)
    total = 0
    for _, prefix in parse_data_path(data_prefix):
        indexed = open_indexed_dataset(prefix)
        (spec, _, _) = _split_specs(prefix, indexed, fractions, (1, 0, 0), seq_length, seed=0)
        total += (spec.tokens_per_epoch - 1) // seq_length
    return total
