"""Several datasets mixed by weight (`--data-path 0.3 A 0.7 B`)."""
import numpy as np
import torch

from megatron.data.dataset_utils import DatasetError, load_helpers


class BlendableDataset(torch.utils.data.Dataset):
    """`size` samples drawn from `datasets` in proportion to `weights`.

    The order is deterministic (no randomness of its own; each dataset is already shuffled):
    sample i comes from the dataset furthest behind its share, so any window of the blended
    order follows the weights closely. Dataset d contributes its samples 0, 1, 2, ... in turn.
    """

    def __init__(self, datasets: list, weights: list[float], size: int):
        if len(datasets) != len(weights) or not datasets:
            raise DatasetError(f"blending needs one weight per dataset, got {len(datasets)} datasets "
                               f"and {len(weights)} weights")
        if any(dataset is None for dataset in datasets):
            raise DatasetError("blending got a missing dataset (a --data-path prefix with no samples in this split)")
        weights = np.asarray(weights, dtype=np.float64)
        if np.any(weights <= 0):
            raise DatasetError(f"blending weights {weights.tolist()} must all be positive")
        self.datasets = list(datasets)
        self.weights = weights / weights.sum()
        self.dataset_index, self.dataset_sample_index = load_helpers().build_blending_indices(self.weights, int(size))
        for d, dataset in enumerate(self.datasets):
            needed = int(np.count_nonzero(self.dataset_index == d))
            if needed > len(dataset):
                raise DatasetError(f"blended dataset {d} has {len(dataset)} samples but the blend needs {needed}")

    def __len__(self) -> int:
        return self.dataset_index.shape[0]

    def __getitem__(self, index: int):
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range for the blended dataset ({len(self)} samples)")
        dataset = self.datasets[int(self.dataset_index[index])]
        return dataset[int(self.dataset_sample_index[index])]
