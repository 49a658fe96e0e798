"""V-Half and V-Min (controllable-memory paper) against 1F1B at TF = TB = TW, and their orders built for other costs."""
import pytest

from megatron_ds.schedules import ScheduleError, build_schedule, simulate
from megatron_ds.schedules.generators.vshape import memory_limit

# Bubble (idle over the whole iteration, worst rank) as a share of 1F1B's: what the orders
# reach. The paper's asymptotic targets are 1/2 (V-Half) and 2/3 (V-Min).
BUBBLE_SHARE = {"zbv-half": 0.55, "zbv-min": 0.73}


@pytest.mark.parametrize("name", ["zbv-half", "zbv-min"])
@pytest.mark.parametrize("p", [4, 8])
@pytest.mark.parametrize("mult", [2, 4])
def test_bubble_and_memory_against_1f1b(name, p, mult):
    m = mult * p
    res = simulate(build_schedule(name, p, m))
    ref = simulate(build_schedule("1f1b", p, m))
    assert res.bubble_ratio <= BUBBLE_SHARE[name] * ref.bubble_ratio
    # The paper's limits in micro-batches: V-Half (p+2)//2, V-Min (p+4)//3; 1F1B holds p.
    limit = memory_limit(p, name.split("-")[1])
    assert res.peak_memory_max <= limit
    assert limit == {("zbv-half", 4): 3, ("zbv-half", 8): 5, ("zbv-min", 4): 2, ("zbv-min", 8): 4}[name, p]
    # V-Min's block also keeps it when W holds all of a forward's activations (the paper's
    # accounting); V-Half's list scheduling counts B as freeing M_B - M_W and does not.
    if name == "zbv-min":
        assert simulate(res.schedule, act_size=(1.0, 1.0)).peak_memory_max <= limit


def test_v_min_asymptotics():
    # Long runs: the building block's steady state has no bubble and V-Min's memory stays.
    p, m = 8, 64
    res = simulate(build_schedule("zbv-min", p, m))
    ref = simulate(build_schedule("1f1b", p, m))
    assert res.bubble_ratio <= 0.67 * ref.bubble_ratio
    assert res.peak_memory_max <= p / 2


def test_memory_orders_against_zbv():
    p, m = 4, 8
    full, half, low = (simulate(build_schedule(n, p, m)) for n in ("zbv", "zbv-half", "zbv-min"))
    assert full.makespan <= half.makespan <= low.makespan
    assert full.peak_memory_max > half.peak_memory_max > low.peak_memory_max


# A layer's TF, TB, TW measured on an H100 (bench/layer_costs.py, LLaMA-7B layer, bf16, seq 4096)
H100_LLAMA = (3.08, 4.37, 2.04)


@pytest.mark.parametrize("costs", [(1.0, 1.5, 0.5), H100_LLAMA])
@pytest.mark.parametrize("name", ["zbv-half", "zbv-min"])
@pytest.mark.parametrize("p, m", [(4, 16), (8, 32)])
def test_order_built_for_the_costs_is_no_slower_and_keeps_the_limit(costs, name, p, m):
    unit = simulate(build_schedule(name, p, m), *costs)
    costed = simulate(build_schedule(name, p, m, op_costs=costs), *costs)
    assert costed.makespan <= unit.makespan + 1e-9
    assert costed.peak_memory_max <= memory_limit(p, name.split("-")[1])


def test_v_half_built_for_the_costs_keeps_up_with_1f1b_where_the_unit_order_does_not():
    for costs, p, m, unit_ratio, costed_ratio in ((H100_LLAMA, 4, 16, 1.18, 0.99), ((1.0, 1.5, 0.5), 4, 16, 1.28, 1.04),
                                                  (H100_LLAMA, 8, 32, 1.20, 1.04)):
        base = simulate(build_schedule("1f1b", p, m), *costs).makespan
        unit = simulate(build_schedule("zbv-half", p, m), *costs).makespan
        costed = simulate(build_schedule("zbv-half", p, m, op_costs=costs), *costs).makespan
        assert unit / base > unit_ratio and costed / base < costed_ratio, (costs, p, unit / base, costed / base)


def test_op_costs_are_relative_and_equal_ones_are_the_default():
    assert build_schedule("zbv-half", 4, 8, op_costs=(2, 3, 1)).ranks == \
        build_schedule("zbv-half", 4, 8, op_costs=(1, 1.5, 0.5)).ranks
    assert build_schedule("zbv-min", 4, 8, op_costs=(5, 5, 5)).ranks == build_schedule("zbv-min", 4, 8).ranks
    assert build_schedule("zbv-half", 4, 8, op_costs=(1, 1.5, 0.5)).ranks != build_schedule("zbv-half", 4, 8).ranks


@pytest.mark.parametrize("bad", [(1, 2), (1, 0, 1), (1, -1, 1)])
def test_bad_op_costs_are_refused(bad):
    with pytest.raises(ScheduleError, match="op_costs"):
        build_schedule("zbv-half", 4, 8, op_costs=bad)


def test_op_costs_only_for_schedules_whose_order_depends_on_them():
    with pytest.raises(ScheduleError, match="zbv does not take op_costs.*apply to zbv-half, zbv-min"):
        build_schedule("zbv", 4, 8, op_costs=(1, 1.5, 0.5))
