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


def test_needs_multiple_of_pp():
    with pytest.raises(ScheduleError, match=r"interleaved with virtual_stages=2 needs micro_batches to be a multiple of pp \(micro_batches=6, pp=4\)"):
        build_schedule("interleaved", 4, 6, virtual_stages=2)
