"""Line-by-line Python ports of Megatron's helpers.cpp loops and index-mapping arithmetic: the oracle our
numpy versions must equal."""
import numpy as np


def build_sample_idx_reference(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch):
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    out = np.zeros((num_samples + 1, 2), dtype=np.int32)
    sample_index, doc_idx_index, doc_offset = 1, 0, 0
    while sample_index <= num_samples:
        remaining = seq_length + 1
        while remaining != 0:
            doc_length = int(sizes[doc_idx[doc_idx_index]]) - doc_offset
            remaining -= doc_length
            if remaining <= 0:
                doc_offset += remaining + doc_length - 1
                remaining = 0
            else:
                doc_idx_index += 1
                doc_offset = 0
        out[sample_index] = (doc_idx_index, doc_offset)
        sample_index += 1
    return out


def build_blending_indices_reference(weights, size):
    weights = [float(w) for w in weights]
    current = [0] * len(weights)
    dataset_index = np.zeros(size, dtype=np.uint8)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    for i in range(size):
        x = max(float(i), 1.0)
        best, best_err = 0, weights[0] * x - float(current[0])
        for d in range(1, len(weights)):
            err = weights[d] * x - float(current[d])
            if err > best_err:
                best, best_err = d, err
        dataset_index[i] = best
        dataset_sample_index[i] = current[best]
        current[best] += 1
    return dataset_index, dataset_sample_index


def build_index_mappings_reference(documents, sizes, num_samples, seq_length, seed):
    """Megatron's _build_index_mappings arithmetic, written the way Megatron writes it."""
    tokens_per_epoch = int(np.sum(sizes[documents]))
    num_epochs, total = 0, 0
    while True:
        num_epochs += 1
        total += tokens_per_epoch
        if (total - 1) // seq_length >= num_samples:
            break
    rng = np.random.RandomState(seed=seed)
    separate = False
    if num_epochs > 1:
        from_full = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        separate = (num_samples - from_full) < int(0.80 * ((tokens_per_epoch - 1) // seq_length))

    def doc_idx_for(epochs):
        d = np.mgrid[0:epochs, 0:len(documents)][1]
        d[:] = documents
        d = d.reshape(-1).astype(np.int32)
        rng.shuffle(d)
        return d

    if separate:
        doc_idx = np.concatenate((doc_idx_for(num_epochs - 1), doc_idx_for(1)))
    else:
        doc_idx = doc_idx_for(num_epochs)
    sample_idx = build_sample_idx_reference(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch)
    total_samples = sample_idx.shape[0] - 1
    first_part = from_full if separate else total_samples
    shuffle_first = np.arange(0, first_part, dtype=np.uint32)
    rng.shuffle(shuffle_first)
    if first_part == total_samples:
        shuffle_idx = shuffle_first
    else:
        shuffle_last = np.arange(first_part, total_samples, dtype=np.uint32)
        rng.shuffle(shuffle_last)
        shuffle_idx = np.concatenate((shuffle_first, shuffle_last))
    return doc_idx, sample_idx, shuffle_idx, num_epochs, separate
