import pytest

from megatron_ds.schedules import ScheduleError, build_schedule, order_text, simulate


@pytest.mark.parametrize("p, m, v", [(4, 4, 2), (4, 8, 2), (4, 8, 4), (8, 16, 2)])
def test_bubble_ratio(p, m, v):
    res = simulate(build_schedule("interleaved", p, m, virtual_stages=v), 1, 1, 1)
    assert res.bubble_ratio == pytest.approx((p - 1) / (v * m + p - 1))


def test_megatron_order_and_warmup():
    s = build_schedule("interleaved", 2, 4, virtual_stages=2)
    assert s.placement == [[0, 1, 0, 1]]
    assert order_text(s, [1]) == (
        "rank1: F0 F1 F0' BW0' F1' BW1' F2 BW0 F3 BW1 F2' BW2' F3' BW3' BW2 BW3")
    # Warm-up 2(p-1-r) + (v-1)p chunk forwards on rank 0, then the first 1F1B pair.
    first_bw = next(i for i, op in enumerate(s.ranks[0]) if op.kind == "BW")
    assert first_bw == 2 + 2 + 1


def test_more_messages_than_1f1b():
    one = simulate(build_schedule("1f1b", 4, 8)).p2p_messages
    two = simulate(build_schedule("interleaved", 4, 8, virtual_stages=2)).p2p_messages
    assert one == 2 * 3 * 8
    assert two == 2 * 7 * 8


def test_needs_equal_rounds():
    # PyTorch's flexible rule: max(1, m // p) rounds of equal size.
    with pytest.raises(ScheduleError, match=r"interleaved with virtual_stages=2 needs micro_batches to split into max\(1, micro_batches // pp\) = 2 equal rounds \(micro_batches=9, pp=4\)"):
        build_schedule("interleaved", 4, 9, virtual_stages=2)


@pytest.mark.parametrize("p, m", [(4, 2), (4, 6), (4, 10), (4, 12), (8, 12), (8, 20)])
def test_micro_batches_not_a_multiple_of_pp(p, m):
    s = build_schedule("interleaved", p, m, virtual_stages=2)   # validated by build_schedule
    one = simulate(build_schedule("1f1b", p, m))
    assert simulate(s).makespan < one.makespan
