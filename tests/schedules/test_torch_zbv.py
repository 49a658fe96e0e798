"""Cross-check: our ZB-V lists against PyTorch's ScheduleZBVZeroBubble order, both run
through our simulator (the package never imports torch; only this test does)."""
import pytest

from megatron_ds.schedules import Op, Schedule, build_schedule, simulate, validate

pipelining = pytest.importorskip("torch.distributed.pipelining.schedules")

# PyTorch letters: I = input-grad backward (our B), B = full backward (our BW).
TORCH_KIND = {"F": "F", "I": "B", "W": "W", "B": "BW"}


def torch_zbv(p, m):
    # The order is a pure function of (p, m); build the object without stages or a
    # process group and ask it for every rank's list.
    sched = object.__new__(pipelining.ScheduleZBVZeroBubble)
    sched.pp_group_size = p
    sched.num_stages = 2 * p
    sched._n_microbatches = m
    ranks = []
    for r in range(p):
        actions = [a for a in sched._calculate_single_rank_operations(r) if a is not None]
        ranks.append([Op(TORCH_KIND[a.computation_type.value], 0, a.stage_index, a.microbatch_index)
                      for a in actions])
    mapping = pipelining.generate_stage_to_rank_mapping(p, 2 * p, style="v")
    placement = [[mapping[s] for s in range(2 * p)]]
    s = Schedule("torch-zbv", p, m, 1, 2 * p, 1, placement, ranks)
    validate(s)
    return s


def test_placement_agrees():
    assert torch_zbv(4, 8).placement == build_schedule("zbv", 4, 8).placement


@pytest.mark.parametrize("p, m", [(4, 4), (4, 8), (4, 12), (4, 16), (8, 8), (8, 16), (8, 24), (8, 32)])
@pytest.mark.parametrize("costs", [(1, 1, 1), (1, 1, 0.5), (1, 2, 1), (1, 1.5, 0.5)])
def test_zbv_no_longer_than_pytorch(p, m, costs):
    ours = simulate(build_schedule("zbv", p, m), *costs)
    theirs = simulate(torch_zbv(p, m), *costs)
    assert ours.makespan <= theirs.makespan
    assert max(ours.peak_memory) <= max(theirs.peak_memory)


def test_pytorch_reaches_the_bound_too():
    # The bound from SCHEDULES.md, for the record of what the cross-check compares.
    assert simulate(torch_zbv(4, 8), 1, 1, 1).makespan == 25.5
