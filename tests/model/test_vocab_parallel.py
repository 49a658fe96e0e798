"""model/vocab_parallel.py on 2 and 4 gloo ranks: the sliced loss, the input gradient of the logits'
input, and the embedding's and output layer's weight gradients (tied and untied) equal the
whole-vocabulary computation within 1e-6 of the largest value compared (fp32: a loss of ~20 carries
rounding of ~2e-6 in either computation), with the S and T passes whole and a chunk of tokens at a time.
One launch per world size serves every case."""
import pytest

from megatron_ds.model.vocab_parallel import vocab_range
from megatron_ds.testing.launcher import launches_by_world

from .vocab_parallel_ranks import run_all


@pytest.fixture(scope="module")
def results():
    return launches_by_world(run_all, timeout=300)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("tied", [False, True])
def test_sliced_equals_whole_vocabulary(results, world, tied):
    for rank, cases in enumerate(results(world)):
        assert {chunk for _, _, chunk in cases} == {0, 3}
        for (case_tied, seed, chunk), (diff, scale) in cases.items():
            if case_tied != tied:
                continue
            assert set(diff) == ({"loss", "input_grad", "embedding_grad"} | (set() if tied else {"head_grad"}))
            for what, d in diff.items():
                assert d <= 1e-6 * max(1.0, scale[what]), (world, rank, seed, chunk, what, d, scale[what])
            assert min(scale.values()) > 1e-3   # the compared values are not all ~0


def test_vocab_range_splits_evenly_or_says_why():
    assert [vocab_range(48, r, 4) for r in range(4)] == [(0, 12), (12, 24), (24, 36), (36, 48)]
    with pytest.raises(ValueError, match="pad it to a multiple of 5"):
        vocab_range(48, 0, 5)
