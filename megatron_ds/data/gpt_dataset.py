"""Megatron's GPT dataset: fixed-length samples cut from a shuffled stream of documents.

For a document range, num_samples, seq_length and seed, three index arrays are
built once (by global rank 0, the others wait at a barrier) and cached as .npy
next to the data (or under --data-cache-path, created if missing), named by
everything they depend on:

    {prefix}_{name}_indexmap_{num_samples}ns_{seq_length}sl_{seed}s_{first}-{end}docs_{digest}
        _{doc,sample,shuffle}_idx.npy

Megatron's names end at `{seed}s`; the document range (what --split selects) and a
digest of those documents' sizes (what a re-preprocessed corpus changes) make a
cache that was built for other documents another file, never a wrong answer: a
changed --split or corpus builds its own cache, and a run that died half-way
leaves at most files that are never read again.

- doc_idx: the document ids of all needed epochs, shuffled (np.random.RandomState(seed)).
- sample_idx: where each sample starts, as (index into doc_idx, token offset).
- shuffle_idx: a permutation of the samples (same RNG, after doc_idx).
Sample i is seq_length + 1 tokens; consecutive samples share one token (the
label shift), documents run into each other (Megatron does not pad or split).
"""
import hashlib
import os
import time

import numpy as np
from torch.utils.data import Dataset

from megatron_ds.files import write_atomic

from .blendable_dataset import BlendableDataset
from .dataset_utils import DataConfigError, get_datasets_weights_and_num_samples, get_train_valid_test_split_
from .dist_utils import barrier, get_rank, print_rank_0
from .helpers import build_sample_idx
from .indexed_dataset import make_dataset as make_indexed_dataset


def build_train_valid_test_datasets(data_prefix, data_impl, splits_string, train_valid_test_num_samples,
                                    seq_length, seed, skip_warmup, data_cache_path=None):
    """(train, valid, test) datasets; a split with no documents is None.

    data_prefix is the --data-path list: ["PREFIX"] or ["0.3", "A", "0.7", "B"].
    data_cache_path (optional) puts the .npy index caches there instead of next
    to the data, for read-only corpora.
    """
    if isinstance(data_prefix, str):
        data_prefix = [data_prefix]
    if len(data_prefix) == 0:
        raise DataConfigError("--data-path is empty")
    if len(train_valid_test_num_samples) != 3:
        raise DataConfigError("train_valid_test_num_samples needs three counts (train, valid, test)")
    if len(data_prefix) == 1:
        return _build_for_prefix(data_prefix[0], data_impl, splits_string, train_valid_test_num_samples,
                                 seq_length, seed, skip_warmup, data_cache_path)

    prefixes, weights, per_dataset_samples = get_datasets_weights_and_num_samples(
        data_prefix, train_valid_test_num_samples)
    splits = ([], [], [])
    for prefix, num_samples in zip(prefixes, per_dataset_samples):
        built = _build_for_prefix(prefix, data_impl, splits_string, num_samples, seq_length, seed,
                                  skip_warmup, data_cache_path)
        for kept, ds in zip(splits, built):
            if ds is not None:
                kept.append(ds)
    result = []
    for name, kept in zip(("train", "valid", "test"), splits):
        if not kept:
            result.append(None)
            continue
        have = {d.data_prefix for d in kept}
        missing = [p for p in prefixes if p not in have]
        if missing and name == "train":
            # Megatron crashes here; training on a blend without some of its parts is never intended.
            raise DataConfigError(f"--split {splits_string!r} leaves no training documents in {missing}; "
                                  f"the blend weights could not apply")
        if missing:
            # Small corpora round a 1 % split to zero documents; evaluate on the others.
            print_rank_0(f" > WARNING: no {name} documents in {missing}; blending the {name} split "
                         f"of the other datasets with their weights renormalised")
        result.append(BlendableDataset(kept, [w for w, p in zip(weights, prefixes) if p in have],
                                       cache_dir=data_cache_path or os.path.dirname(os.path.abspath(prefixes[0]))))
    return tuple(result)


def _build_for_prefix(data_prefix, data_impl, splits_string, num_samples, seq_length, seed,
                      skip_warmup, data_cache_path):
    start = time.time()
    indexed = make_indexed_dataset(data_prefix, data_impl, skip_warmup)
    total = indexed.sizes.shape[0]
    print_rank_0(f" > {data_prefix}: {total} documents, opened in {time.time() - start:.3f} s")
    splits = get_train_valid_test_split_(splits_string, total)

    def build(index, name):
        if splits[index + 1] <= splits[index]:
            return None
        print_rank_0(f"    {name}: document indices in [{splits[index]}, {splits[index + 1]})")
        documents = np.arange(splits[index], splits[index + 1], dtype=np.int32)
        return GPTDataset(name, data_prefix, documents, indexed, num_samples[index], seq_length, seed,
                          data_cache_path=data_cache_path)

    return build(0, "train"), build(1, "valid"), build(2, "test")


class GPTDataset(Dataset):
    """Samples {'text': int64[seq_length + 1]} over `documents` of `indexed_dataset`."""

    def __init__(self, name, data_prefix, documents, indexed_dataset, num_samples, seq_length, seed,
                 data_cache_path=None):
        self.name = name
        self.data_prefix = data_prefix
        self.indexed_dataset = indexed_dataset
        documents = np.asarray(documents)
        if len(documents) == 0 or documents.min() < 0 or documents.max() >= indexed_dataset.sizes.shape[0]:
            raise DataConfigError(f"{data_prefix}: document ids must lie in [0, "
                                  f"{indexed_dataset.sizes.shape[0]})")
        self.doc_idx, self.sample_idx, self.shuffle_idx = build_index_mappings(
            name, data_prefix, documents, indexed_dataset.sizes, num_samples, seq_length, seed,
            data_cache_path)

    def __len__(self):
        # sample i spans sample_idx[i] .. sample_idx[i + 1], hence the -1.
        return self.sample_idx.shape[0] - 1

    def __getitem__(self, idx):
        idx = self.shuffle_idx[idx]
        doc_f, offset_f = (int(v) for v in self.sample_idx[idx])
        doc_l, offset_l = (int(v) for v in self.sample_idx[idx + 1])
        get = self.indexed_dataset.get
        if doc_f == doc_l:
            sample = get(int(self.doc_idx[doc_f]), offset=offset_f, length=offset_l - offset_f + 1)
        else:
            parts = [get(int(self.doc_idx[doc_f]), offset=offset_f)]
            parts.extend(get(int(self.doc_idx[i])) for i in range(doc_f + 1, doc_l))
            parts.append(get(int(self.doc_idx[doc_l]), length=offset_l + 1))
            sample = np.concatenate(parts)
        return {"text": np.array(sample, dtype=np.int64)}


def index_cache_paths(name, data_prefix, documents, sizes, num_samples, seq_length, seed, data_cache_path=None):
    """The three .npy paths: Megatron's name plus the document range and a digest of their sizes."""
    base = data_prefix
    if data_cache_path:
        base = os.path.join(data_cache_path, os.path.basename(data_prefix))
    documents = np.asarray(documents)
    digest = hashlib.blake2b(np.ascontiguousarray(documents).tobytes(), digest_size=5)
    digest.update(np.ascontiguousarray(np.asarray(sizes)[documents]).tobytes())
    span = f"{int(documents.min())}-{int(documents.max()) + 1}docs" if len(documents) else "0docs"
    stem = f"{base}_{name}_indexmap_{num_samples}ns_{seq_length}sl_{seed}s_{span}_{digest.hexdigest()}"
    return stem + "_doc_idx.npy", stem + "_sample_idx.npy", stem + "_shuffle_idx.npy"


def num_epochs_needed(tokens_per_epoch, seq_length, num_samples):
    """Smallest number of epochs whose tokens give num_samples samples.

    The last token of a sample is the first of the next, hence the -1.
    """
    if tokens_per_epoch <= 1:
        raise DataConfigError(f"the documents hold {tokens_per_epoch} token(s); a sample needs at least 2")
    epochs = max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))
    while ((epochs - 1) * tokens_per_epoch - 1) // seq_length >= num_samples and epochs > 1:
        epochs -= 1
    while (epochs * tokens_per_epoch - 1) // seq_length < num_samples:
        epochs += 1
    return epochs


def build_index_mappings(name, data_prefix, documents, sizes, num_samples, seq_length, seed,
                         data_cache_path=None):
    """(doc_idx, sample_idx, shuffle_idx), from the .npy cache, built by rank 0 if missing."""
    if seq_length < 1:
        raise DataConfigError(f"seq_length must be positive, got {seq_length}")
    if num_samples < 0:
        raise DataConfigError(f"{name}: negative number of samples {num_samples}")
    tokens_per_epoch = int(np.sum(sizes[documents], dtype=np.int64))
    num_epochs = num_epochs_needed(tokens_per_epoch, seq_length, num_samples)
    paths = index_cache_paths(name, data_prefix, documents, sizes, num_samples, seq_length, seed, data_cache_path)

    error = None
    if get_rank() == 0 and not all(os.path.isfile(p) for p in paths):
        try:
            if data_cache_path:
                os.makedirs(data_cache_path, exist_ok=True)
            _build_and_save(paths, documents, sizes, num_samples, seq_length, seed, num_epochs,
                            tokens_per_epoch)
        except Exception as e:  # still reach the barrier so the other ranks do not hang
            error = e
    barrier()
    if error is not None:
        raise error
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise DataConfigError(f"index cache {missing[0]} was not built (see rank 0's error)")
    doc_idx, sample_idx, shuffle_idx = (load_index_cache(p) for p in paths)
    print_rank_0(f"    {name}: {sample_idx.shape[0] - 1} samples over {num_epochs} epoch(s)")
    return doc_idx, sample_idx, shuffle_idx


def load_index_cache(path):
    """A cache file as a read-only memory map, never unpickled: np.load with allow_pickle would run a pickle
    put in its place (a cache directory shared between users), memory-mapping refuses object arrays."""
    try:
        arr = np.load(path, allow_pickle=False, mmap_mode="r")
    except (ValueError, OSError, EOFError) as e:
        why = "it holds pickled data, which could run code when loaded" if "pickle" in str(e) else str(e)
        raise DataConfigError(f"index cache {path} is refused: {why} (an index cache holds one integer array; "
                              "delete the file to rebuild it)") from None
    if arr.dtype.kind not in "iu" or arr.ndim not in (1, 2):
        raise DataConfigError(f"index cache {path} is refused: it holds a {arr.ndim}-d {arr.dtype} array, not "
                              "integer indices (delete the file to rebuild it)")
    return arr


def _build_and_save(paths, documents, sizes, num_samples, seq_length, seed, num_epochs, tokens_per_epoch):
    start = time.time()
    rng = np.random.RandomState(seed=seed)
    separate_last_epoch = False
    from_full_epochs = 0
    if num_epochs > 1:
        # When the last epoch contributes under 80 % of an epoch's samples, shuffle it
        # on its own so those few samples are not spread over the whole run.
        from_full_epochs = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        last_epoch_samples = num_samples - from_full_epochs
        per_epoch = (tokens_per_epoch - 1) // seq_length
        separate_last_epoch = last_epoch_samples < int(0.80 * per_epoch)
    doc_idx = _build_doc_idx(documents, num_epochs, rng, separate_last_epoch)
    sample_idx = build_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch)
    total = sample_idx.shape[0] - 1
    shuffle_idx = _build_shuffle_idx(from_full_epochs if separate_last_epoch else total, total, rng)
    for path, arr in zip(paths, (doc_idx, sample_idx, shuffle_idx)):
        _save_atomic(path, arr)
    print_rank_0(f"    built index mappings ({total} samples, {num_epochs} epochs) "
                 f"in {time.time() - start:.3f} s")


def _build_doc_idx(documents, num_epochs, rng, separate_last_epoch):
    if not separate_last_epoch or num_epochs == 1:
        doc_idx = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
        rng.shuffle(doc_idx)
        return doc_idx
    first = _build_doc_idx(documents, num_epochs - 1, rng, False)
    last = _build_doc_idx(documents, 1, rng, False)
    return np.concatenate((first, last))


def _build_shuffle_idx(num_samples, total_size, rng):
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def _save_atomic(path, arr):
    write_atomic(path, lambda tmp: np.save(tmp, arr, allow_pickle=False), suffix=".npy")
