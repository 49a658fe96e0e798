"""Megatron's BlendableDataset: several datasets interleaved by weight, deterministically.

No randomness: sample i goes to the dataset that is most behind its share
(helpers.build_blending_indices); each dataset keeps its own shuffled order.
The indices depend on the weights and the size alone, so they are cached as
blending_indices_{k}ds_{size}ns_{digest of the weights}.npz (as megatron-core
does): a relaunch of a large blend loads them instead of recomputing.
"""
import hashlib
import os
import time

import numpy as np
from torch.utils.data import Dataset

from megatron_ds.files import write_atomic

from .dataset_utils import DataConfigError
from .dist_utils import get_rank, print_rank_0
from .helpers import build_blending_indices



class BlendableDataset(Dataset):
    def __init__(self, datasets, weights, cache_dir=None):
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
        self.dataset_index, self.dataset_sample_index = cached_blending_indices(self.weights, self.size, cache_dir)
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


def cached_blending_indices(weights, size, cache_dir=None):
    """build_blending_indices, through an .npz cache in cache_dir (written by rank 0, atomically)."""
    if cache_dir is None:
        return build_blending_indices(weights, size)
    digest = hashlib.blake2b(np.asarray(weights, dtype=np.float64).tobytes(), digest_size=5).hexdigest()
    path = os.path.join(cache_dir, f"blending_indices_{len(weights)}ds_{size}ns_{digest}.npz")
    if os.path.isfile(path):
        try:  # never unpickled: a cache folder may be shared, and a pickle in its place would run code
            with np.load(path, allow_pickle=False) as cached:
                return cached["dataset_index"], cached["dataset_sample_index"]
        except (ValueError, OSError, KeyError, EOFError) as e:
            why = "it holds pickled data, which could run code when loaded" if "pickle" in str(e) else str(e)
            raise DataConfigError(f"blending cache {path} is refused: {why} (delete the file to rebuild it)") from None
    dataset_index, dataset_sample_index = build_blending_indices(weights, size)
    if get_rank() == 0:
        os.makedirs(cache_dir, exist_ok=True)
        write_atomic(path, lambda tmp: np.savez(tmp, dataset_index=dataset_index,
                                                dataset_sample_index=dataset_sample_index), suffix=".npz")
    return dataset_index, dataset_sample_index
