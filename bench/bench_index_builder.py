"""Benchmark the GPT dataset's index building on a synthetic corpus (no files needed).

Times, on --docs documents of random lengths (1-billion tokens by default), one epoch:

  cpp-sample-idx   the C++ builder megatron.data.helpers.build_sample_idx alone
  full-index       everything a split's first build does: doc_idx shuffle, sample_idx, shuffle_idx
  numpy-reference  a vectorized numpy construction (cumulative sums + searchsorted), full size
  python-reference a plain Python walk over the documents (Megatron's original algorithm) on
                   the first --slice-docs documents, scaled linearly to the full corpus

and fails unless both references equal the C++ output. Wall and CPU seconds are printed
(CPU seconds are less sensitive to other load on a shared machine).

    python bench/bench_index_builder.py [--docs 2000000] [--mean-doc-tokens 500] [--seq-length 2048]
"""
import argparse
import sys
import time

import numpy as np

from megatron.data import helpers
from megatron.data.gpt_dataset import SampleSpec, build_index_arrays


def timed(function, *args):
    wall, cpu = time.perf_counter(), time.process_time()
    result = function(*args)
    return result, time.perf_counter() - wall, time.process_time() - cpu


def numpy_sample_idx(sizes, doc_idx, seq_length, num_samples):
    """Sample k starts at token k * seq_length: find its document by binary search."""
    ends = np.cumsum(sizes[doc_idx], dtype=np.int64)  # tokens up to and including position p
    targets = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    positions = np.searchsorted(ends, targets, side="right")
    starts = ends[positions] - sizes[doc_idx[positions]]
    return np.stack([positions, targets - starts], axis=1)


def python_sample_idx(sizes, doc_idx, seq_length, num_samples):
    """Walk the shuffled documents, advancing seq_length tokens per sample."""
    doc_sizes = [sizes[d] for d in doc_idx.tolist()]
    rows = [(0, 0)]
    position, offset = 0, 0
    for _ in range(num_samples):
        remaining = seq_length
        while remaining >= doc_sizes[position] - offset:
            remaining -= doc_sizes[position] - offset
            position += 1
            offset = 0
        offset += remaining
        rows.append((position, offset))
    return np.array(rows, dtype=np.int64)


def report(name, wall, cpu, tokens, note=""):
    print(f"{name:<18} wall {wall:8.3f} s | cpu {cpu:8.3f} s | {tokens / max(wall, 1e-9) / 1e9:7.2f} G tokens/s {note}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=2_000_000)
    parser.add_argument("--mean-doc-tokens", type=int, default=500, help="lengths uniform in [1, 2*mean)")
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--slice-docs", type=int, default=200_000, help="documents for the Python reference")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()

    rng = np.random.default_rng(args.seed)
    sizes = rng.integers(1, 2 * args.mean_doc_tokens, size=args.docs).astype(np.int32)
    tokens = int(sizes.sum())
    num_samples = (tokens - 1) // args.seq_length
    print(f"corpus: {args.docs} documents, {tokens / 1e9:.3f} G tokens, seq length {args.seq_length}, "
          f"{num_samples} samples (one epoch)")
    doc_idx = rng.permutation(args.docs).astype(np.int64)

    cpp, wall, cpu = timed(helpers.build_sample_idx, sizes, doc_idx, args.seq_length, 1, tokens)
    report("cpp-sample-idx", wall, cpu, tokens)
    spec = SampleSpec("train", "synthetic", 0, args.docs, tokens, "synthetic", num_samples,
                      args.seq_length, args.seed)
    _, wall, cpu = timed(build_index_arrays, spec, sizes)
    report("full-index", wall, cpu, tokens, "(doc_idx + sample_idx + shuffle_idx)")
    reference, wall, cpu = timed(numpy_sample_idx, sizes, doc_idx, args.seq_length, num_samples)
    report("numpy-reference", wall, cpu, tokens)
    if not np.array_equal(reference, cpp):
        sys.exit("error: the numpy reference differs from the C++ sample index")

    part = doc_idx[: args.slice_docs]
    part_tokens = int(sizes[part].sum())
    part_samples = (part_tokens - 1) // args.seq_length
    reference, wall, cpu = timed(python_sample_idx, sizes, part, args.seq_length, part_samples)
    scale = tokens / part_tokens
    report("python-reference", wall * scale, cpu * scale, tokens,
           f"(measured {wall:.3f} s on {args.slice_docs} documents, scaled x{scale:.0f})")
    if not np.array_equal(reference, cpp[: part_samples + 1]):
        sys.exit("error: the Python reference differs from the C++ sample index")
    print("outputs equal: C++ == numpy reference (full) == Python reference (slice)")


if __name__ == "__main__":
    main()
