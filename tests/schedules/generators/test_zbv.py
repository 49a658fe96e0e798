import pytest

from megatron_ds.schedules import build_schedule, simulate


def test_v_placement():
    s = build_schedule("zbv", 4, 8)
    assert s.placement == [[0, 1, 2, 3, 3, 2, 1, 0]]
    assert s.chunks_on(0) == [(0, 0), (0, 7)]
    assert s.rank_of(0, s.loss_stage) == 0


@pytest.mark.parametrize("p", [4, 8])
@pytest.mark.parametrize("m_per_p", [2, 3, 4])
@pytest.mark.parametrize("costs", [(1, 1, 1), (1, 1, 0.5)])
def test_makespan_reaches_start_up_bound(p, m_per_p, costs):
    m = m_per_p * p
    tf, tb, tw = costs
    res = simulate(build_schedule("zbv", p, m), tf, tb, tw)
    assert res.makespan == m * (tf + tb + tw) + (p - 1) * tf / 2


def test_reference_value_and_1f1b():
    assert simulate(build_schedule("zbv", 4, 8), 1, 1, 1).makespan == 25.5
    assert simulate(build_schedule("1f1b", 4, 8), 1, 1, 1).makespan == 33


def test_memory_equals_1f1b_peak_balanced_over_ranks():
    zbv = simulate(build_schedule("zbv", 4, 16), act_size=(1.0, 0.5))
    one = simulate(build_schedule("1f1b", 4, 16), act_size=(1.0, 0.5))
    assert zbv.peak_memory == [4.0] * 4
    assert max(zbv.peak_memory) == max(one.peak_memory)


def test_twice_the_messages_of_1f1b():
    zbv = simulate(build_schedule("zbv", 4, 8)).p2p_messages
    one = simulate(build_schedule("1f1b", 4, 8)).p2p_messages
    assert zbv == 2 * one


@pytest.mark.parametrize("m", [1, 3, 4, 7])
def test_few_micro_batches_still_valid(m):
    s = build_schedule("zbv", 4, m)
    assert sum(len(ops) for ops in s.ranks) == 3 * 8 * m


@pytest.mark.parametrize("p", [4, 8])
def test_m_equal_p_reaches_the_bound_too(p):
    # The hand rule alone leaves (p-1)/2 chunk-forwards idle here; the greedy variant wins.
    for costs in [(1, 1, 1), (1, 1, 0.5)]:
        res = simulate(build_schedule("zbv", p, p), *costs)
        assert res.makespan == p * sum(costs) + (p - 1) * costs[0] / 2
        assert max(res.peak_memory) <= p
