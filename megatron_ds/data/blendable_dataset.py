"""Megatron's BlendableDataset: several datasets interleaved by weight, deterministically.

No randomness: sample i goes to the dataset that is most behind its share
(helpers.build_blending_indices); each dataset keeps its own shuffled order.
"""
import time

import numpy as np

from .dist_utils import print_rank_0
from .helpers import build_blending_indices

try:
    from torch.utils.data import Dataset as _Base
except ImportError:  # pragma: no cover
    _Base = object


class BlendableDataset(_Base):
    def __init__(self, datasets, weights):
        if len(datasets) != len(weights) or not datasets:
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        self.datasets = datasets
        weights = np.asarray(weights, dtype=np.float64)
        if not np.all(weights > 0):
            raise ValueError(f"blend weights must be positive, got {weights.tolist()}")
        self.weights = weights / weights.sum()
        # Megatron sizes the blend as the sum of its parts (each already >= its share).
        self.size = int(sum(len(d) for d in datasets))
        start = time.time()
        self.dataset_index, self.dataset_sample_index = build_blending_indices(self.weights, self.size)
        achieved = np.bincount(self.dataset_index, minlength=len(datasets)) / max(self.size, 1)
        print_rank_0(f" > blended {len(datasets)} datasets into {self.size} samples in "
                     f"{time.time() - start:.3f} s; weights {np.round(self.weights, 4).tolist()}, "
                     f"achieved {np.round(achieved, 4).tolist()}")

    def __len__(self):
        return self.size

    def __getitem__(self, idx):
        d = int(self.dataset_index[idx])
        i = int(self.dataset_sample_index[idx])
        if i >= len(self.datasets[d]):
            # Megatron fails here with a bare IndexError (NVIDIA/Megatron-LM#705).
            raise IndexError(f"blended sample {idx} needs sample {i} of dataset {d}, which has only "
                             f"{len(self.datasets[d])}; ask for fewer samples or rebalance the weights")
        return self.datasets[d][i]
