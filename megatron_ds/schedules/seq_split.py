"""Sequence segment lengths for Seq1F1B.

Under causal attention a token attends to every earlier token, so equal-length segments do
unequal work: the last one is the most expensive. The balanced split gives every segment
the same FLOPs, which makes the first segment the longest.

FLOPs of the tokens [a, b) of one layer (per sequence, forward; backward scales alike) are
flops.span_flops: the linear layers' per token (grouped K/V and SwiGLU counted when the
heads, K/V heads and swiglu are given), plus causal attention's 2h(b^2 - a^2), or under a
document mask the keys its queries see on average (`keys`): where documents are short the
later tokens cost little more than the first, and the split comes out nearly even.
"""
from __future__ import annotations

from typing import Sequence

from .flops import span_flops
from .ir import ScheduleError

SEGMENT_MULTIPLE = 8  # balanced segment lengths the runtime uses are multiples of this (kernel-friendly)


def _check(seq_length: int, k: int, multiple: int) -> None:
    if not isinstance(k, int) or k < 1:
        raise ScheduleError(f"seq_splits must be a positive integer (seq_splits={k!r})")
    if not isinstance(multiple, int) or multiple < 1:
        raise ScheduleError(f"segment multiple must be a positive integer (multiple={multiple!r})")
    if k > seq_length:
        raise ScheduleError(f"seq_splits={k} exceeds seq_length={seq_length}: "
                            "every segment needs at least one token")
    if k * multiple > seq_length:
        raise ScheduleError(f"seq_length={seq_length} is too short for seq_splits={k} segments "
                            f"in multiples of {multiple}")


def even_segment_lengths(seq_length: int, k: int, multiple: int = 1) -> list[int]:
    """k lengths as equal as multiples of `multiple` allow; the first absorbs any rest."""
    _check(seq_length, k, multiple)
    units, rest = divmod(seq_length, multiple)
    q, extra = divmod(units, k)
    lengths = [(q + (1 if i < extra else 0)) * multiple for i in range(k)]
    lengths[0] += rest
    return lengths


def balanced_segment_lengths(seq_length: int, k: int, hidden_size: int,
                             ffn_hidden_size: int | None = None, multiple: int = 8, *, heads: int | None = None,
                             kv_heads: int | None = None, swiglu: bool = False, keys=None,
                             head_dim: int | None = None) -> list[int]:
    """k lengths summing to seq_length whose segments cost the same FLOPs.

    Walking from the start, each segment is the longest multiple of `multiple` whose cost
    does not exceed 1/k of the whole sequence's; the last segment takes the rest.
    heads, kv_heads, swiglu, head_dim: the layer's shape beyond h and f (flops.span_flops). `keys`: a
    document mask's average keys per query (flops.attention_flops), whose segments are weighed by them.
    """
    _check(seq_length, k, multiple)
    if hidden_size < 1:
        raise ScheduleError(f"hidden_size must be positive (hidden_size={hidden_size})")
    shape = dict(heads=heads, kv_heads=kv_heads, swiglu=swiglu, head_dim=head_dim)
    cost = lambda a, b: span_flops(a, b, hidden_size, ffn_hidden_size, keys=keys, **shape)  # noqa: E731
    share = cost(0, seq_length) / k
    lengths, start = [], 0
    for _ in range(k - 1):
        length = multiple
        while start + length + multiple <= seq_length and cost(start, start + length + multiple) <= share:
            length += multiple
        lengths.append(length)
        start += length
    lengths.append(seq_length - start)
    if lengths[-1] < 1:
        raise ScheduleError(f"seq_length={seq_length} is too short for seq_splits={k} balanced "
                            f"segments in multiples of {multiple}")
    return lengths


def segment_costs(lengths: Sequence[int], hidden_size: int, ffn_hidden_size: int | None = None, *,
                  heads: int | None = None, kv_heads: int | None = None, swiglu: bool = False,
                  keys=None, head_dim: int | None = None) -> list[float]:
    """Relative FLOPs of consecutive segments (mean 1), e.g. for simulate(seq_costs=...); `keys`: a
    document mask's (balanced_segment_lengths)."""
    if not lengths or any(n < 1 for n in lengths):
        raise ScheduleError(f"segment lengths must be positive (lengths={list(lengths)})")
    costs, start = [], 0
    for n in lengths:
        costs.append(span_flops(start, start + n, hidden_size, ffn_hidden_size, heads, kv_heads, swiglu, keys,
                                head_dim))
        start += n
    mean = sum(costs) / len(costs)
    return [c / mean for c in costs]
