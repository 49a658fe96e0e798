import numpy as np
import pytest

from megatron_ds.data.helpers import build_blending_indices, build_sample_idx

from .megatron_reference import build_blending_indices_reference, build_sample_idx_reference


@pytest.mark.parametrize("seed", range(12))
def test_build_sample_idx_equals_megatrons_loop(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 60))
    sizes = rng.integers(0, 40, n).astype(np.int32)  # includes empty documents
    sizes[int(rng.integers(n))] += 2
    epochs = int(rng.integers(1, 4))
    seq_length = int(rng.integers(2, 50))
    doc_idx = np.tile(np.arange(n, dtype=np.int32), epochs)
    rng.shuffle(doc_idx)
    tokens = int(sizes.sum())
    ours = build_sample_idx(sizes, doc_idx, seq_length, epochs, tokens)
    theirs = build_sample_idx_reference(sizes, doc_idx, seq_length, epochs, tokens)
    assert ours.dtype == np.int32 and ours.shape == theirs.shape
    assert np.array_equal(ours, theirs)


def test_build_sample_idx_known_values():
    # Documents of 3, 0 and 5 tokens, seq_length 2: samples start at tokens 0, 2, 4, 6.
    sizes = np.array([3, 0, 5], np.int32)
    got = build_sample_idx(sizes, np.array([0, 1, 2], np.int32), 2, 1, 8)
    assert got.tolist() == [[0, 0], [0, 2], [2, 1], [2, 3]]


@pytest.mark.parametrize("weights", [
    [0.3, 0.7], [0.5, 0.5], [1 / 3, 1 / 3, 1 / 3], [0.1, 0.2, 0.3, 0.4], [0.999, 0.001],
    [0.05, 0.15, 0.2, 0.25, 0.1, 0.05, 0.2], [1.0]])
def test_build_blending_indices_equals_megatrons_loop(weights):
    w = np.array(weights) / np.sum(weights)
    size = 30000
    ours = build_blending_indices(w, size)
    theirs = build_blending_indices_reference(w, size)
    assert np.array_equal(ours[0], theirs[0])
    assert np.array_equal(ours[1], theirs[1])


def test_build_blending_indices_random_weights_many_datasets():
    rng = np.random.default_rng(7)
    for k in (3, 12, 40):
        w = rng.random(k)
        w /= w.sum()
        ours = build_blending_indices(w, 5000)
        theirs = build_blending_indices_reference(w, 5000)
        assert np.array_equal(ours[0], theirs[0]) and np.array_equal(ours[1], theirs[1])
