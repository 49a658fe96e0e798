import pytest

from megatron_ds.schedules import build_schedule, order_text, simulate

# SCHEDULES.md reference table: (p, m, costs) -> (ideal, 1F1B, ZB-H1) makespans.
TABLE = [
    (4, 8, (1, 1, 1), 24, 33, 27),
    (4, 8, (1, 1, 0.5), 20, 27.5, 24.5),
    (4, 16, (1, 1, 1), 48, 57, 51),
    (8, 24, (1, 1, 1), 72, 93, 79),
    (8, 24, (1, 1, 0.5), 60, 77.5, 70.5),
]


@pytest.mark.parametrize("p, m, costs, ideal, one_f_one_b, zb_h1", TABLE)
def test_reference_makespans(p, m, costs, ideal, one_f_one_b, zb_h1):
    assert m * sum(costs) == ideal
    assert simulate(build_schedule("1f1b", p, m), *costs).makespan == one_f_one_b
    assert simulate(build_schedule("zb-h1", p, m), *costs).makespan == zb_h1


def test_zb_h1_bubble_formula_and_memory():
    p, m, (tf, tb, tw) = 8, 24, (1.0, 1.5, 0.75)
    zb = simulate(build_schedule("zb-h1", p, m), tf, tb, tw)
    assert zb.makespan == pytest.approx(m * (tf + tb + tw) + (p - 1) * (tf + tb - tw))
    # Paper: stage i (1-based) holds (p-i+1) M_B + (i-1) M_W; here M_W = M_B / 2.
    res = simulate(build_schedule("zb-h1", 4, 8), act_size=(1.0, 0.5))
    assert res.peak_memory == [4.0, 3.5, 3.0, 2.5]
    assert simulate(build_schedule("1f1b", 4, 8)).peak_memory == [4.0, 3.0, 2.0, 1.0]


def test_zb_h1_rank_orders():
    assert order_text(build_schedule("zb-h1", 4, 6), [0, 3]) == (
        "rank0: F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 B3 W3 B4 W4 B5 W5\n"
        "rank3: F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 W3 W4 W5")


@pytest.mark.parametrize("p, m", [(4, 8), (4, 16), (8, 16), (8, 32), (6, 12)])
@pytest.mark.parametrize("costs", [(1, 1, 1), (1, 1, 0.5)])
def test_zb_h2_reaches_start_up_bound(p, m, costs):
    res = simulate(build_schedule("zb-h2", p, m), *costs)
    # The last rank cannot start before p-1 forwards; after that nobody idles.
    assert res.makespan == m * sum(costs) + (p - 1) * costs[0]
    assert res.peak_memory[0] == 2 * p - 1   # micro-batches in flight on rank 0, any m


def test_zb_h2_beats_zb_h1_with_cheap_w():
    for p, m in [(4, 8), (8, 24)]:
        h1 = simulate(build_schedule("zb-h1", p, m), 1, 1, 0.5).makespan
        h2 = simulate(build_schedule("zb-h2", p, m), 1, 1, 0.5).makespan
        assert h2 == h1 - (p - 1) * 0.5


@pytest.mark.parametrize("p, m", [(4, 8), (4, 16), (8, 16), (8, 32), (6, 12)])
def test_zb_h2_is_a_parallelogram(p, m):
    # At TF = TB = TW every rank is busy from its first op to its last: rank r starts at r.
    res = simulate(build_schedule("zb-h2", p, m), 1, 1, 1)
    assert res.own_bubble == [0.0] * p
    assert [res.start[ops[0]] for ops in res.schedule.ranks] == list(range(p))
