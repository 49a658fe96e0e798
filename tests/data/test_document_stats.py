"""Seq1F1B's balanced split under a document mask: the keys a query sees on average over a corpus (against
every token of the stream as the sample's start, counted directly), and the segments it weighs with them:
equal FLOPs under the mask, nearly even where documents are short, causal's cut where they are long."""
import numpy as np
import pytest

from megatron_ds.data.document_stats import _tail, document_keys
from megatron_ds.schedules.flops import span_flops
from megatron_ds.schedules.seq_split import balanced_segment_lengths, segment_costs
from megatron_ds.testing.corpus import write_corpus


def test_average_keys_count_each_documents_earlier_tokens():
    sizes, seq = [3, 7, 1, 12, 5], 9
    tail = _tail(sizes, seq)
    keys = np.concatenate([[0.0], np.cumsum(tail[1:])])
    # a random token of the stream: A earlier tokens of its document; min(t, A) of them within the sample
    ages = np.concatenate([np.arange(n) for n in sizes])
    expected = [np.minimum(t, ages).mean() for t in range(seq + 1)]
    assert np.allclose(keys, expected)


def test_corpus_prefix_sums_and_blend(tmp_path):
    prefix = write_corpus(str(tmp_path / "corpus"), num_docs=30)
    sums = document_keys([prefix], 256)
    assert len(sums) == 257 and sums[0] == 0.0 and sums[1] == 0.0  # position 0 sees no earlier key
    steps = np.diff(sums)  # keys(t): rising, and below causal's t once documents end (21..121 tokens here)
    assert np.all(np.diff(steps) >= -1e-12) and steps[200] < 100
    assert document_keys(["2", prefix, "1", prefix], 256) == pytest.approx(sums)


def test_balanced_split_weighs_the_mask():
    h, f, seq, k = 512, 2048, 8192, 4
    causal = balanced_segment_lengths(seq, k, h, f)
    long_docs = tuple(t * (t - 1) / 2 for t in range(seq + 1))  # keys(t) = t: one document spans every sample
    assert balanced_segment_lengths(seq, k, h, f, keys=long_docs) == pytest.approx(causal, abs=16)
    ages = np.arange(256)  # every document 256 tokens long
    keys = [np.minimum(t, ages).mean() for t in range(seq + 1)]
    short = tuple(np.concatenate([[0.0], np.cumsum(keys[:-1])]))
    lengths = balanced_segment_lengths(seq, k, h, f, keys=short)
    assert sum(lengths) == seq and max(lengths) - min(lengths) <= 32 < max(causal) - min(causal)
    costs, causal_costs = segment_costs(lengths, h, f, keys=short), segment_costs(causal, h, f, keys=short)
    assert max(costs) - min(costs) < 0.02 < 0.3 < max(causal_costs) - min(causal_costs)  # causal's cut: unequal
    assert span_flops(0, seq, h, f, keys=short) < span_flops(0, seq, h, f)  # the mask leaves attention out
