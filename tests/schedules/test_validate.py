import pytest

from megatron_ds.schedules import Op, Schedule, ScheduleError, build_schedule, validate


def _two_rank(rank0, rank1, m=2):
    return Schedule("hand", 2, m, 1, 2, 1, [[0, 1]], [rank0, rank1])


def F(s, mb):
    return Op("F", 0, s, mb)


def BW(s, mb):
    return Op("BW", 0, s, mb)


def test_accepts_hand_written_1f1b():
    validate(_two_rank([F(0, 0), F(0, 1), BW(0, 0), BW(0, 1)],
                       [F(1, 0), BW(1, 0), F(1, 1), BW(1, 1)]))


def test_rejects_missing_op():
    s = build_schedule("1f1b", 4, 4)
    s.ranks[2] = [op for op in s.ranks[2] if op != Op("BW", 0, 2, 3)]
    with pytest.raises(ScheduleError, match=r"stage 2, mb 3, seq 0\) has no backward"):
        validate(s)


def test_rejects_missing_micro_batch():
    s = build_schedule("1f1b", 2, 2)
    s.ranks = [[op for op in lst if op.mb != 1] for lst in s.ranks]
    with pytest.raises(ScheduleError, match="micro-batch 1 has no ops"):
        validate(s)


def test_rejects_backward_before_its_forward():
    s = _two_rank([F(0, 0), F(0, 1), BW(0, 0), BW(0, 1)],
                  [BW(1, 0), F(1, 0), F(1, 1), BW(1, 1)])
    with pytest.raises(ScheduleError, match=r"rank 1 runs BW\(r0,s1,mb0,q0\) \(op #0\) before its dependency F\(r0,s1,mb0,q0\)"):
        validate(s)


def test_rejects_cyclic_wait_across_two_ranks():
    # Rank 1 wants mb 1 first, but rank 0 only sends it after mb 0's backward, which
    # needs rank 1 to have run mb 0.
    s = _two_rank([F(0, 0), BW(0, 0), F(0, 1), BW(0, 1)],
                  [F(1, 1), F(1, 0), BW(1, 0), BW(1, 1)])
    with pytest.raises(ScheduleError, match="deadlock: rank 0 waits at BW.*on rank 1; rank 1 waits at F.*on rank 0"):
        validate(s)


def test_rejects_duplicate_and_misplaced_and_mixed_ops():
    base = [[F(0, 0), BW(0, 0)], [F(1, 0), BW(1, 0)]]
    with pytest.raises(ScheduleError, match="appears 2 times"):
        validate(_two_rank(base[0] + [F(0, 0)], base[1], m=1))
    with pytest.raises(ScheduleError, match="placed on rank 1"):
        validate(_two_rank(base[0] + [F(1, 0)], base[1][1:], m=1))
    with pytest.raises(ScheduleError, match="both BW and B/W"):
        validate(_two_rank(base[0] + [Op("B", 0, 0, 0), Op("W", 0, 0, 0)], base[1], m=1))
    with pytest.raises(ScheduleError, match="a B but no W"):
        validate(_two_rank([F(0, 0), Op("B", 0, 0, 0)], base[1], m=1))


def test_rejects_w_before_b_on_same_rank():
    s = _two_rank([F(0, 0), Op("W", 0, 0, 0), Op("B", 0, 0, 0)], [F(1, 0), BW(1, 0)], m=1)
    with pytest.raises(ScheduleError, match=r"runs W\(.*before its dependency B"):
        validate(s)


def test_rejects_wrong_shape():
    s = build_schedule("1f1b", 2, 2)
    s.ranks.append([])
    with pytest.raises(ScheduleError, match="3 rank lists for pp=2"):
        validate(s)


def test_rejects_split_backward_before_its_forward():
    s = build_schedule("zb-h1", 2, 2)
    ops = s.ranks[0]
    b = ops.index(Op("B", 0, 0, 1))
    s.ranks[0] = [ops[b]] + ops[:b] + ops[b + 1:]
    with pytest.raises(ScheduleError, match=r"rank 0 runs B\(r0,s0,mb1,q0\) \(op #0\) before its dependency F\(r0,s0,mb1,q0\)"):
        validate(s)


def test_accepts_waits_but_rejects_a_cycle_with_split_backward():
    # Rank 0 wants mb 1's input gradient before mb 0's, rank 1 sends them in the other
    # order and holds mb 1's forward until mb 0's backward: a cycle through three ops.
    s = build_schedule("zb-h1", 2, 2)
    s.ranks[0] = [Op("F", 0, 0, 0), Op("F", 0, 0, 1), Op("B", 0, 0, 1), Op("B", 0, 0, 0),
                  Op("W", 0, 0, 0), Op("W", 0, 0, 1)]
    s.ranks[1] = [Op("F", 0, 1, 0), Op("B", 0, 1, 0), Op("F", 0, 1, 1), Op("B", 0, 1, 1),
                  Op("W", 0, 1, 0), Op("W", 0, 1, 1)]
    validate(s)   # legal: rank 0 just waits for mb 1's gradient
    s.ranks[1] = [Op("F", 0, 1, 1), Op("B", 0, 1, 1), Op("W", 0, 1, 1),
                  Op("F", 0, 1, 0), Op("B", 0, 1, 0), Op("W", 0, 1, 0)]
    validate(s)   # also legal: rank 1 simply serves mb 1 first
    s.ranks[0] = [Op("F", 0, 0, 0), Op("B", 0, 0, 0), Op("F", 0, 0, 1), Op("B", 0, 0, 1),
                  Op("W", 0, 0, 0), Op("W", 0, 0, 1)]
    with pytest.raises(ScheduleError, match="deadlock"):
        validate(s)
