import pytest

from megatron_ds.schedules import Op, ScheduleError, build_schedule, simulate


def test_op_times_1f1b():
    res = simulate(build_schedule("1f1b", 2, 2), tf=1, tb=2, tw=1)
    assert [(op.kind, op.mb, res.start[op], res.end[op]) for op in res.schedule.ranks[1]] == [
        ("F", 0, 1, 2), ("BW", 0, 2, 5), ("F", 1, 5, 6), ("BW", 1, 6, 9)]
    assert res.start[Op("BW", 0, 0, 0)] == 5
    assert res.makespan == 12
    assert res.busy == [8, 8]
    assert res.bubble == [pytest.approx(1 / 3)] * 2
    # Rank 1 idles 1 unit before its first op and 3 between F1 and F0's BW on rank 0.
    assert res.own_bubble[1] == pytest.approx(0.0)


def test_p2p_latency_delays_cross_rank_edges_only():
    s = build_schedule("zbv", 2, 4)
    base = simulate(s).makespan
    slow = simulate(s, p2p_latency=0.5)
    # A micro-batch crosses ranks twice each way; the local V-turn on rank 1 is free.
    assert slow.p2p_messages == 4 * 4
    assert slow.makespan > base
    f = simulate(build_schedule("1f1b", 3, 1), p2p_latency=0.25)
    assert f.start[Op("F", 0, 2, 0)] == pytest.approx(2 * (1 + 0.25))
    assert f.p2p_sent == [1, 2, 1]


def test_per_stage_costs():
    s = build_schedule("1f1b", 2, 4)
    res = simulate(s, tf=[1, 2], tb=[1, 2], tw=0)
    # The heavier last stage sets the pace: m*(2+2) plus the first stage's forward and backward.
    assert res.makespan == 4 * 4 + 1 + 1
    with pytest.raises(ScheduleError, match="tf lists 3 costs for a schedule with 2 stages"):
        simulate(s, tf=[1, 1, 1])


def test_chunked_schedules_scale_costs():
    # Interleaved v=2: an op costs p/S = 1/2 of a 1F1B stage's.
    res = simulate(build_schedule("interleaved", 2, 2, virtual_stages=2), tf=1, tb=1, tw=0)
    durations = {res.end[op] - res.start[op] for op in res.schedule.ranks[0]}
    assert durations == {0.5}


def test_segment_costs_normalized():
    s = build_schedule("seq1f1b", 1, 1, seq_splits=2)
    res = simulate(s, tf=3, tb=3, tw=0, seq_costs=[1, 2])
    assert [res.end[op] - res.start[op] for op in res.schedule.ranks[0]] == [1, 2, 2, 1]


def test_memory_models():
    s = build_schedule("zb-h1", 2, 2)
    assert simulate(s, act_size=(1.0, 0.0)).peak_memory == [2.0, 1.0]
    # Rank 1 holds W0 back: F0 (2) B0 (keeps 1) F1 (3).
    assert simulate(s, act_size=2.0).peak_memory == [4.0, 3.0]
    # A callable gives each op's own (M_B, M_W): here the last stage keeps logits too.
    heavy = simulate(s, act_size=lambda op: (3.0, 0.0) if op.stage == 1 else (1.0, 0.0))
    assert heavy.peak_memory == [2.0, 3.0]


def test_gpipe_memory_and_bubble():
    res = simulate(build_schedule("gpipe", 4, 8))
    assert res.peak_memory == [8.0] * 4
    assert res.bubble_ratio == pytest.approx(3 / 11)


def test_rejects_invalid_schedule():
    s = build_schedule("1f1b", 2, 2)
    s.ranks[0].reverse()
    with pytest.raises(ScheduleError, match="before its dependency"):
        simulate(s)


def test_op_overhead_is_paid_per_op_whatever_its_size():
    # 1 rank, 1 micro-batch, TF=TB=2: one F+BW costs 4; cut into 2 segments, 4 ops pay 4 fixed times
    whole = simulate(build_schedule("1f1b", 1, 1), tf=2, tb=2, tw=0, op_overhead=(0.5, 0.25, 0.0))
    cut = simulate(build_schedule("seq1f1b", 1, 1, seq_splits=2), tf=2, tb=2, tw=0, op_overhead=(0.5, 0.25, 0.0))
    assert whole.makespan == pytest.approx(4 + 0.75) and cut.makespan == pytest.approx(4 + 1.5)
    # a split backward: B pays TB's fixed time, W its own; BW both
    split = simulate(build_schedule("zb-h1", 1, 1), tf=1, tb=1, tw=1, op_overhead=(0.0, 0.25, 0.5))
    assert [split.end[op] - split.start[op] for op in split.schedule.ranks[0]] == [1.0, 1.25, 1.5]


def test_a_fused_backward_may_cost_its_own_time():
    # dualpipev runs fused BW ops beside split B and W ones: measured apart, BW costs tbw, not tb + tw
    s = build_schedule("dualpipev", 2, 4)
    kinds = {op.kind for ops in s.ranks for op in ops}
    assert {"B", "W", "BW"} <= kinds
    own = simulate(s, tf=1, tb=1, tw=1, tbw=1.5)
    assert {own.end[op] - own.start[op] for ops in s.ranks for op in ops if op.kind == "BW"} == {0.75}  # p/S of it
    assert own.makespan < simulate(s, tf=1, tb=1, tw=1).makespan
    assert simulate(s, tf=1, tb=1, tw=1, tbw=2).makespan == simulate(s, tf=1, tb=1, tw=1).makespan


def test_segments_hold_their_tokens_share_of_memory():
    # 1 rank, k=2 segments of 12 and 4 tokens: both forwards held, 0.75 + 0.25 at the peak
    known = build_schedule("seq1f1b", 1, 1, seq_splits=2, segment_lengths=[12, 4])
    assert simulate(known).peak_memory == [pytest.approx(1.0)]
    assert simulate(known, act_size=(1.0, 0.0)).peak_memory == [pytest.approx(1.0)]
    # p=2, m=2: rank 0 runs F(0,0) F(0,1) F(1,0) before its first backward: 12+4+12 tokens = 1.75 micro-batches,
    # where counting segments as halves says 1.5
    two = build_schedule("seq1f1b", 2, 2, seq_splits=2, segment_lengths=[12, 4])
    plain = build_schedule("seq1f1b", 2, 2, seq_splits=2)
    assert simulate(two).peak_memory == [1.75, 1.0] and simulate(plain).peak_memory == [1.5, 1.0]
