import pytest

from megatron_ds.schedules import ScheduleError, build_schedule, simulate
from megatron_ds.schedules.seq_split import (balanced_segment_lengths, even_segment_lengths,
                                             segment_costs)


@pytest.mark.parametrize("seq, h, expected", [
    (32768, 4096, [11128, 8400, 7040, 6200]),      # SCHEDULES.md example (7B, 32K)
    (16384, 2560, [5344, 4224, 3608, 3208]),
    (65536, 4096, [25248, 16216, 12952, 11120]),
    (65536, 6144, [23472, 16616, 13616, 11832]),
])
def test_balanced_lengths(seq, h, expected):
    lengths = balanced_segment_lengths(seq, 4, h)
    assert lengths == expected
    assert sum(lengths) == seq
    assert all(n % 8 == 0 for n in lengths[:-1])
    costs = segment_costs(lengths, h)
    assert max(costs) - min(costs) < 0.01


def test_even_split_costs_grow():
    lengths = even_segment_lengths(32768, 4)
    assert lengths == [8192] * 4
    assert [round(c, 2) for c in segment_costs(lengths, 4096)] == [0.70, 0.90, 1.10, 1.30]


def test_even_lengths_with_rest():
    # 12 units of 8 tokens over 3 segments, the 4 leftover tokens go to the first.
    assert even_segment_lengths(100, 3, multiple=8) == [36, 32, 32]
    assert even_segment_lengths(10, 3) == [4, 3, 3]


def test_ffn_size_changes_the_split():
    default = balanced_segment_lengths(32768, 4, 4096)
    wide = balanced_segment_lengths(32768, 4, 4096, ffn_hidden_size=8 * 4096)
    assert sum(wide) == 32768
    # A heavier MLP weighs the linear part more, so the split gets closer to even.
    assert 8192 < wide[0] < default[0]


def test_balanced_split_fixes_the_bubble():
    s = build_schedule("seq1f1b", 8, 8, seq_splits=4)
    even = segment_costs(even_segment_lengths(32768, 4), 4096)
    balanced = segment_costs(balanced_segment_lengths(32768, 4, 4096), 4096)
    assert simulate(s, 1, 2, 0, seq_costs=even).bubble_ratio == pytest.approx(0.354, abs=0.001)
    assert simulate(s, 1, 2, 0, seq_costs=balanced).bubble_ratio == pytest.approx(0.181, abs=0.002)


@pytest.mark.parametrize("call, message", [
    (lambda: balanced_segment_lengths(3, 4, 64), r"seq_splits=4 exceeds seq_length=3"),
    (lambda: balanced_segment_lengths(20, 4, 64), r"too short for seq_splits=4 segments in multiples of 8"),
    (lambda: even_segment_lengths(16, 0), r"seq_splits must be a positive integer"),
])
def test_refuses_bad_settings(call, message):
    with pytest.raises(ScheduleError, match=message):
        call()
