"""Seq1F1B capped at 1F1B's token count per rank: every rank's peak tokens in flight <= (p - r)
micro-batches for the balanced split, the lists stay valid, and the simulated makespan does not grow."""
import pytest

from megatron_ds.schedules import build_schedule, simulate
from megatron_ds.schedules.kinds import Kind
from megatron_ds.schedules.seq_split import balanced_segment_lengths, segment_costs
from megatron_ds.schedules.token_cap import cap_tokens


def peak_tokens(ops, lengths):
    held = top = 0
    for op in ops:
        held += lengths[op.seq] if op.kind is Kind.F else -lengths[op.seq] if op.kind in (Kind.B, Kind.BW) else 0
        top = max(top, held)
    return top


@pytest.mark.parametrize("pp,m,k,hidden,split", [(4, 8, 4, 256, False), (8, 16, 4, 256, False), (4, 8, 2, 256, False),
                                                 (4, 8, 4, 256, True), (8, 32, 4, 1024, False)])
def test_capped_seq1f1b_holds_no_more_tokens_than_1f1b(pp, m, k, hidden, split):
    lengths = balanced_segment_lengths(2048, k, hidden)
    costs = segment_costs(lengths, hidden)
    plain = build_schedule("seq1f1b", pp, m, seq_splits=k, split_backward=split)
    capped = cap_tokens(build_schedule("seq1f1b", pp, m, seq_splits=k, split_backward=split), lengths)
    assert peak_tokens(plain.ranks[-1], lengths) > 2048  # the balanced split's long first segment
    assert [peak_tokens(ops, lengths) <= (pp - r) * 2048 for r, ops in enumerate(capped.ranks)] == [True] * pp
    assert [sorted(map(str, ops)) for ops in capped.ranks] == [sorted(map(str, ops)) for ops in plain.ranks]
    for tb in (1.0, 2.0):
        before = simulate(plain, 1.0, tb, tb, seq_costs=costs).makespan
        assert simulate(capped, 1.0, tb, tb, seq_costs=costs).makespan <= before + 1e-9


def test_even_segments_leave_the_order_alone():
    plain = build_schedule("seq1f1b", 4, 8, seq_splits=4)
    assert cap_tokens(build_schedule("seq1f1b", 4, 8, seq_splits=4), [512] * 4).ranks == plain.ranks
