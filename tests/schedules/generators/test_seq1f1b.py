import pytest

from megatron_ds.schedules import ScheduleError, build_schedule, simulate

REF = {
    0: "F1.1 F1.2 F2.1 F2.2 F3.1 B1.2 F3.2 B1.1 F4.1 B2.2 F4.2 B2.1 B3.2 B3.1 B4.2 B4.1",
    3: "F1.1 F1.2 B1.2 F2.1 B1.1 F2.2 B2.2 F3.1 B2.1 F3.2 B3.2 F4.1 B3.1 F4.2 B4.2 B4.1",
}


def one_based(schedule, rank):
    return " ".join(f"{'F' if op.kind == 'F' else 'B'}{op.mb + 1}.{op.seq + 1}"
                    for op in schedule.ranks[rank])


def test_reference_order():
    s = build_schedule("seq1f1b", 4, 4, seq_splits=2)
    for rank, text in REF.items():
        assert one_based(s, rank) == text
    assert {op.kind for _, _, op in s.ops()} == {"F", "BW"}


@pytest.mark.parametrize("p", [4, 8])
@pytest.mark.parametrize("m", [4, 8])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_bubble_ratio_balanced_segments(p, m, k):
    res = simulate(build_schedule("seq1f1b", p, m, seq_splits=k), 1.0, 2.0, 0.0)
    assert res.bubble_ratio == pytest.approx((p - 1) / (m * k + p - 1))


def test_first_stage_memory():
    # (p+k-1)/k micro-batches of activations against p for 1F1B: 34 % at p=8, k=4.
    res = simulate(build_schedule("seq1f1b", 8, 8, seq_splits=4))
    assert res.peak_memory[0] == pytest.approx(11 / 4)


def test_uneven_segment_costs_hurt():
    s = build_schedule("seq1f1b", 8, 8, seq_splits=4)
    even = simulate(s, 1.0, 2.0, 0.0, seq_costs=[0.70, 0.90, 1.10, 1.30]).bubble_ratio
    balanced = simulate(s, 1.0, 2.0, 0.0).bubble_ratio
    assert balanced == pytest.approx(7 / 39)
    assert even > balanced + 0.1


def test_interleaved_variant():
    p, m, k, v = 4, 4, 2, 2
    s = build_schedule("seq1f1b", p, m, seq_splits=k, virtual_stages=v)
    assert s.stages == 8 and s.placement == [[0, 1, 2, 3, 0, 1, 2, 3]]
    res = simulate(s, 1.0, 2.0, 0.0)
    assert res.bubble_ratio == pytest.approx((p - 1) / (v * m * k + p - 1))


@pytest.mark.parametrize("v", [1, 2])
def test_split_backward_variant(v):
    p, m, k = 8, 8, 2
    fused = build_schedule("seq1f1b", p, m, seq_splits=k, virtual_stages=v)
    split = build_schedule("seq1f1b", p, m, seq_splits=k, virtual_stages=v, split_backward=True)
    assert {op.kind for _, _, op in split.ops()} == {"F", "B", "W"}
    for costs in [(1, 1, 1), (1, 1, 0.5)]:
        assert simulate(split, *costs).makespan < simulate(fused, *costs).makespan
    # B's keep the segment order: last segment first within a micro-batch.
    bs = [(op.mb, op.seq) for op in split.ranks[0] if op.kind == "B" and op.stage == 0]
    assert bs[:4] == [(0, 1), (0, 0), (1, 1), (1, 0)]


def test_interleaved_needs_whole_groups():
    with pytest.raises(ScheduleError, match=r"micro_batches\*seq_splits to be a multiple of pp"):
        build_schedule("seq1f1b", 4, 3, seq_splits=1, virtual_stages=2)
