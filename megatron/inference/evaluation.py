"""Validation loss of a model on the validation split of a Megatron dataset, as training computes it.

The split is Megatron's `--split` over documents; the samples are the same seq_length + 1 token
windows (built by megatron.data.gpt_dataset) that pretrain_gpt.py evaluates, one pass over them.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from megatron.data.dataset_utils import DatasetError, parse_data_path, parse_splits, split_boundaries
from megatron.data.gpt_dataset import build_train_valid_test_datasets
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.model import GPTModel


@dataclass
class LossResult:
    loss: float
    num_samples: int
    num_tokens: int
    seconds: float

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss) if self.loss < 700 else float("inf")


def single_prefix(data_path: list[str]) -> str:
    pairs = parse_data_path(data_path)
    if len(pairs) != 1:
        raise DatasetError(f"--data-path {' '.join(data_path)}: give one dataset prefix (blends are not evaluated)")
    return pairs[0][1]


def validation_documents(indexed: MMapIndexedDataset, split: str, prefix: str) -> range:
    bounds = split_boundaries(parse_splits(split), len(indexed))
    documents = range(bounds[1], bounds[2])
    if not documents:
        raise DatasetError(f"--split {split!r} gives the validation split 0 of the {len(indexed)} documents "
                           f"of {prefix}")
    return documents


@torch.no_grad()
def validation_loss(model: GPTModel, prefix: str, split: str, seq_length: int, seed: int,
                    micro_batch_size: int, max_samples: int | None = None) -> LossResult:
    """Mean per-token loss over one pass of the validation samples (or the first max_samples)."""
    indexed = MMapIndexedDataset(prefix)
    documents = validation_documents(indexed, split, prefix)
    tokens = int(indexed.sizes[documents.start:documents.stop].sum(dtype=np.int64))
    num_samples = (tokens - 1) // seq_length
    if max_samples is not None:
        num_samples = min(num_samples, max_samples)
    if num_samples < 1:
        raise DatasetError(f"--data-path {prefix}: the validation split has {tokens} tokens, too few for one "
                           f"sample of --seq-length {seq_length}")
    _, valid, _ = build_train_valid_test_datasets([prefix], split, (0, num_samples, 0), seq_length, seed)
    device = next(model.parameters()).device
    start, total = time.perf_counter(), 0.0
    for first in range(0, num_samples, micro_batch_size):
        batch = np.stack([valid[i]["text"] for i in range(first, min(first + micro_batch_size, num_samples))])
        text = torch.from_numpy(batch).to(device)
        positions = torch.arange(seq_length, device=device).unsqueeze(0).expand(text.shape[0], -1)
        total += float(model(text[:, :-1], positions, labels=text[:, 1:]).float().sum())
    return LossResult(loss=total / (num_samples * seq_length), num_samples=num_samples,
                      num_tokens=num_samples * seq_length, seconds=time.perf_counter() - start)
