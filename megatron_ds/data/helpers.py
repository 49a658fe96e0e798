"""Numpy versions of Megatron's C++ `helpers` (no compiled extension).

Both functions return exactly what Megatron's helpers.cpp returns for the same
inputs; tests/data compare them with line-by-line ports of the C++ loops.
"""
import numpy as np


def build_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch):
    """[num_samples + 1, 2] array of (index into doc_idx, token offset in that document).

    Megatron walks the documents sample by sample; each sample takes seq_length + 1
    tokens and the next one starts on the last of them. So row i is just the
    position of global token i * seq_length in the shuffled token stream (row 0 is
    (0, 0)), which searchsorted finds for all rows at once. Empty documents hold
    no position, which is also how the C++ loop skips them.
    """
    if seq_length < 1:
        raise ValueError(f"seq_length must be positive, got {seq_length}")
    num_samples = (num_epochs * int(tokens_per_epoch) - 1) // seq_length
    doc_lengths = np.asarray(sizes)[np.asarray(doc_idx)].astype(np.int64)
    doc_ends = np.cumsum(doc_lengths)
    if len(doc_ends) == 0 or doc_ends[-1] < num_samples * seq_length + 1:
        raise ValueError("doc_idx holds fewer tokens than num_epochs * tokens_per_epoch")
    positions = np.arange(1, num_samples + 1, dtype=np.int64) * seq_length
    docs = np.searchsorted(doc_ends, positions, side="right")
    offsets = positions - (doc_ends[docs] - doc_lengths[docs])
    # Megatron stores int32 (and overflows past 2**31); keep its dtype while values fit.
    dtype = np.int32 if len(doc_ends) < np.iinfo(np.int32).max else np.int64
    sample_idx = np.zeros((num_samples + 1, 2), dtype=dtype)
    sample_idx[1:, 0] = docs
    sample_idx[1:, 1] = offsets
    return sample_idx


def build_blending_indices(weights, size):
    """(dataset_index, dataset_sample_index) for `size` blended samples.

    Megatron's rule, sample by sample: with x = max(i, 1), take the dataset k with
    the largest error weights[k] * x - taken[k] (the first one on ties), then
    record (k, taken[k]) and count it. It is sequential, so we *guess* a chunk of
    choices vectorially (dataset k's m-th pick is due near x = m / w_k), then check
    every guess against the rule with the counts the guesses imply. The prefix
    that passes is exact; at the first failure the rule's own answer is exact too.
    Where guesses keep failing (many datasets with uneven weights) a plain loop
    takes over for a stretch, so the cost never exceeds the loop by much.
    """
    w = np.asarray(weights, dtype=np.float64)
    k = len(w)
    dataset_index = np.zeros(size, dtype=np.uint8 if k < 256 else np.int32)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    counts = np.zeros(k, dtype=np.int64)
    pos, chunk = 0, 4096
    max_chunk = max(1024, min(1 << 20, (1 << 23) // max(k, 1)))
    while pos < size:
        n = min(chunk, size - pos)
        accepted = _vectorized_stretch(w, counts, pos, n, dataset_index, dataset_sample_index)
        pos += accepted
        if accepted == n:
            chunk = min(chunk * 2, max_chunk)
        elif accepted < 256:
            pos += _loop_stretch(w, counts, pos, min(8192, size - pos), dataset_index,
                                 dataset_sample_index)
            chunk = 4096
    return dataset_index, dataset_sample_index


def _vectorized_stretch(w, counts, pos, n, dataset_index, dataset_sample_index):
    k = len(w)
    guess = _guess(w, counts, n)
    picked = np.zeros((n, k), dtype=np.int64)
    picked[np.arange(n), guess] = 1
    taken = np.cumsum(picked, axis=0)
    taken -= picked
    taken += counts
    x = np.maximum(np.arange(pos, pos + n), 1).astype(np.float64)
    rule = np.argmax(w[None, :] * x[:, None] - taken, axis=1)
    wrong = np.flatnonzero(rule != guess)
    good = n if len(wrong) == 0 else int(wrong[0]) + 1
    choice = rule[:good]
    dataset_index[pos:pos + good] = choice
    dataset_sample_index[pos:pos + good] = taken[np.arange(good), choice]
    counts += np.bincount(choice, minlength=k)
    return good


def _guess(w, counts, n):
    keys, owners = [], []
    for d in range(len(w)):
        if w[d] <= 0:
            continue
        m = int(n * w[d]) + 2
        keys.append((counts[d] + np.arange(m)) / w[d])
        owners.append(np.full(m, d))
    keys, owners = np.concatenate(keys), np.concatenate(owners)
    order = np.lexsort((owners, keys))[:n]
    return owners[order]


def _loop_stretch(w, counts, pos, n, dataset_index, dataset_sample_index):
    weights = [float(v) for v in w]
    taken = [int(c) for c in counts]
    k = len(weights)
    kinds = np.empty(n, dtype=np.int64)
    nth = np.empty(n, dtype=np.int64)
    for j in range(n):
        i = pos + j
        x = float(i) if i > 1 else 1.0
        best, best_err = 0, weights[0] * x - taken[0]
        for d in range(1, k):
            err = weights[d] * x - taken[d]
            if err > best_err:
                best, best_err = d, err
        kinds[j] = best
        nth[j] = taken[best]
        taken[best] += 1
    dataset_index[pos:pos + n] = kinds
    dataset_sample_index[pos:pos + n] = nth
    counts[:] = taken
    return n
