"""Vocabulary parallelism's simulated bar: with the vocabulary passes on every rank, every supported schedule's
iteration is within 5 % of its balanced ideal, and the vocabulary layers' memory (their parameters and
the logits held) is the same on every rank within 10 %; under the V schedules, whose activations are
balanced already, so is each rank's whole peak. Head = 1, 3, 6 layers; p = 4, 8; m = 2p, 4p."""
import pytest

from bench.vocab_parallel import SCHEDULES, build_all, run

LAYERS = 32


@pytest.fixture(scope="module")
def built():
    return build_all((4, 8), LAYERS)


@pytest.mark.parametrize("pp", [4, 8])
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_vocab_parallel_is_balanced(built, name, pp):
    for m in (2 * pp, 4 * pp):
        for c in (1, 3, 6):
            r = run(name, pp, m, c, LAYERS, built)
            where = f"{name} p={pp} m={m} c={c}"
            vocab, naive, ideal = r["vocab"], r["naive"], r["ideal"]
            assert vocab.makespan <= 1.05 * ideal.makespan, where
            assert vocab.makespan < naive.makespan, where
            assert max(vocab.vocab_peak) <= 1.10 * min(vocab.vocab_peak), where
            assert max(vocab.vocab_peak) < max(naive.vocab_peak), where
            if name in ("zbv", "zbv-half"):
                assert max(vocab.peak) <= 1.10 * min(vocab.peak), where
