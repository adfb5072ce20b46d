"""Concatenate mmap indexed datasets into one (documents keep their order and boundaries).

    python tools/merge_datasets.py --input DIR_OR_PREFIX [DIR_OR_PREFIX ...] --output-prefix OUT

A directory stands for every PREFIX.bin/PREFIX.idx pair in it, in sorted order (as Megatron's
merge_datasets.py). All inputs must share one dtype. The merged files are written under
temporary names and renamed at the end.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from megatron.data.indexed_dataset import (
    IndexedDatasetError,
    MMapIndexedDataset,
    MMapIndexedDatasetBuilder,
    data_file_path,
    index_file_path,
)


def expand_inputs(inputs: list[str]) -> list[str]:
    """Prefixes named by `inputs`: a directory gives all its .idx/.bin pairs, sorted."""
    prefixes = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = sorted(str(idx.with_suffix("")) for idx in path.glob("*.idx") if idx.with_suffix(".bin").is_file())
            if not found:
                raise IndexedDatasetError(f"--input {item}: directory holds no PREFIX.bin/PREFIX.idx pairs")
            prefixes += found
        elif MMapIndexedDataset.exists(item):
            prefixes.append(item)
        else:
            raise IndexedDatasetError(f"--input {item}: neither a directory nor a prefix with {item}.bin and {item}.idx")
    return prefixes


def merge(prefixes: list[str], output_prefix: str) -> MMapIndexedDataset:
    resolved_output = Path(output_prefix).resolve()
    if any(Path(prefix).resolve() == resolved_output for prefix in prefixes):
        raise IndexedDatasetError(f"--output-prefix {output_prefix}: is also an input")
    dtype = MMapIndexedDataset(prefixes[0]).dtype
    builder = MMapIndexedDatasetBuilder(data_file_path(output_prefix), dtype=dtype)
    try:
        for prefix in prefixes:
            builder.merge_file_(prefix)
        builder.finalize(index_file_path(output_prefix))
    except BaseException:
        builder.discard()
        raise
    return MMapIndexedDataset(output_prefix)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", required=True, help="directories and/or dataset prefixes, merged in order")
    parser.add_argument("--output-prefix", required=True, help="writes OUT.bin and OUT.idx")
    args = parser.parse_args(argv)
    try:
        prefixes = expand_inputs(args.input)
        merged = merge(prefixes, args.output_prefix)
    except IndexedDatasetError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    tokens = int(np.sum(merged.sizes, dtype=np.int64))
    print(f"merged {len(prefixes)} datasets -> {args.output_prefix}: {len(merged.doc_idx) - 1} documents, {tokens} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
