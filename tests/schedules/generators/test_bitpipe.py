import pytest

from megatron_ds.schedules import Op, ScheduleError, build_schedule, simulate

# SCHEDULES.md, 1-based micro-batches, ' = second leg (stages >= p).
REF_P4_M4 = [
    "F1 F2 F3 F3' F4 F4' F1' B1' F2' B2' B3' B3 B4' B4 B1 B2",
    "F1 F3 F2 F4 F3' F1' F4' F2' B1' B3' B2' B4' B3 B1 B4 B2",
    "F3 F1 F4 F2 F1' F3' F2' F4' B3' B1' B4' B2' B1 B3 B2 B4",
    "F3 F4 F1 F1' F2 F2' F3' B3' F4' B4' B1' B1 B2' B2 B3 B4",
]
REF_P8_M8_RANK0 = ("F1 F2 F3 F4 F5 F5' F6 F6' F7 F7' F8 F8' F1' B1' F2' B2' F3' B3' "
                   "F4' B4' B5' B5 B6' B6 B7' B7 B8' B8 B1 B2 B3 B4")


def paper_notation(schedule, rank):
    p = schedule.pp
    return " ".join(("F" if op.kind == "F" else "B") + str(op.mb + 1) + ("'" if op.stage >= p else "")
                    for op in schedule.ranks[rank])


def chunk_units(schedule):
    # Chunk F = 1, chunk BW = 2: with S = 2p stages an op costs p/S of tf/tb.
    return simulate(schedule, tf=2, tb=4, tw=0, act_size=(1.0, 0.0))


def test_reference_order_and_28_units():
    s = build_schedule("bitpipe", 4, 4)
    assert [paper_notation(s, r) for r in range(4)] == REF_P4_M4
    res = chunk_units(s)
    assert res.makespan == 28
    assert res.busy == [24] * 4
    assert res.bubble_ratio == pytest.approx(2 / 14)   # (p-2)/(3m+p-2)


def test_placement_and_replicas():
    s = build_schedule("bitpipe", 4, 8)
    assert s.placement == [[0, 1, 2, 3, 3, 2, 1, 0], [3, 2, 1, 0, 0, 1, 2, 3]]
    assert s.chunks_on(0) == [(0, 0), (0, 7), (1, 3), (1, 4)]
    assert [s.mb_replica()[mb] for mb in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert s.rank_of(1, 0) == 3 and s.rank_of(1, s.loss_stage) == 3
    assert Op("F", 1, 4, 2) in s.ranks[0]


def test_p8_unit_matches_reference():
    s = build_schedule("bitpipe", 8, 8)
    assert paper_notation(s, 0) == REF_P8_M8_RANK0
    assert chunk_units(s).bubble_ratio == pytest.approx(0.2)   # (p-2)/(3m+p-2)


def test_units_join_at_least_as_tightly_as_the_paper():
    # Paper's B1 F5 F6 B2 junction: 53 units at p=4, m=8 (released code: 54).
    assert chunk_units(build_schedule("bitpipe", 4, 8)).makespan <= 53
    # Released code's direct concatenation at p=8: 0.158 (m=16), 0.135 (m=32).
    assert chunk_units(build_schedule("bitpipe", 8, 16)).bubble_ratio < 0.158
    assert chunk_units(build_schedule("bitpipe", 8, 32)).bubble_ratio < 0.135


def test_memory_does_not_grow_with_units():
    one = chunk_units(build_schedule("bitpipe", 8, 8)).peak_memory
    four = chunk_units(build_schedule("bitpipe", 8, 32)).peak_memory
    assert four == one
    assert max(one) == 8   # p micro-batch activations, as 1F1B's first stage


@pytest.mark.parametrize("pp, m, message", [
    (3, 6, r"bitpipe needs an even pipeline size \(pp=3\)"),
])
def test_constraints(pp, m, message):
    with pytest.raises(ScheduleError, match=message):
        build_schedule("bitpipe", pp, m)


@pytest.mark.parametrize("p, m", [(4, 5), (4, 6), (4, 7), (8, 12), (8, 20)])
def test_micro_batches_not_a_multiple_of_pp(p, m):
    s = build_schedule("bitpipe", p, m)   # validated by build_schedule
    down = [mb for mb, rep in sorted(s.mb_replica().items()) if rep == 0]
    full = [mb for mb in range(m) if (mb % p) < p // 2]
    assert down == full   # the partial unit's first p/2 micro-batches go down
    assert max(chunk_units(s).peak_memory) <= p
