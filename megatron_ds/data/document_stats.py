"""How many keys a query sees under a document mask (--reset-attention-mask), on average over a corpus: what
Seq1F1B's balanced split weighs its segments by (schedules/seq_split.py), read from the .idx files at parse time
(numpy, no torch).

A GPT sample is seq_length + 1 consecutive tokens of the shuffled document stream, so its first token falls
anywhere in a document. Let A be the number of earlier tokens of its own document a random token of the
stream has: a document of L tokens gives A = 0..L-1, so P(A >= a) = sum over documents of max(L - a, 0) /
sum of L. The query at position t of a sample sees min(t, A) earlier keys of its document: on average
keys(t) = sum_{a=1..t} P(A >= a), which is t without documents (the causal count the split uses otherwise).
A blend mixes its datasets' P(A >= a) by their weights.
"""
import numpy as np

from .indexed_dataset import MMapIndexedDataset


def _tail(sizes, seq_length):
    """P(A >= a) for a = 0..seq_length, of documents of these sizes."""
    sizes = np.asarray(sizes, dtype=np.int64)
    clipped = np.minimum(sizes, seq_length + 1)  # every size above seq_length exceeds every a asked
    counts = np.bincount(clipped, minlength=seq_length + 2).astype(np.float64)
    sums = np.bincount(clipped, weights=sizes.astype(np.float64), minlength=seq_length + 2)
    longer = np.cumsum(counts[::-1])[::-1]  # longer[a]: documents of at least a tokens
    longer_sum = np.cumsum(sums[::-1])[::-1]
    a = np.arange(seq_length + 1)
    above = longer[1:seq_length + 2], longer_sum[1:seq_length + 2]  # L > a
    return (above[1] - a * above[0]) / max(float(sizes.sum()), 1.0)


def document_keys(data_path, seq_length):
    """Prefix sums K[t], t = 0..seq_length, of keys(t) over the corpus `data_path` (--data-path: a PREFIX, or
    WEIGHT PREFIX pairs): the attention work of the queries [a, b) is proportional to K[b] - K[a]."""
    if len(data_path) == 1:
        blend = [(1.0, data_path[0])]
    else:
        blend = [(float(w), p) for w, p in zip(data_path[0::2], data_path[1::2])]
    total = sum(w for w, _ in blend)
    tail = sum(w / total * _tail(MMapIndexedDataset(p, skip_warmup=True).sizes, seq_length) for w, p in blend)
    keys = np.concatenate([[0.0], np.cumsum(tail[1:])])  # keys(t) for t = 0..seq_length
    return tuple(float(k) for k in np.concatenate([[0.0], np.cumsum(keys[:-1])]))
