"""Overlapped units: a forward and a backward of other micro-batches on one rank, run as one unit
so that each one's all-to-all hides behind the other's compute. The IR's record (Schedule.overlap), its JSON
field, the validator's rules, the simulator's time for a unit (checked against values worked out by hand),
the generators (dualpipev's reference pairs, 1F1B's and interleaved's combined steady state), the pictures
and the traces."""
import json

import pytest

from megatron_ds.schedules import (Op, Schedule, ScheduleError, build_schedule, from_file, order_text, simulate,
                                   validate)
from megatron_ds.schedules.catalog import takes
from megatron_ds.schedules.costs import PIECES_MOE, ModelCosts, evaluate
from megatron_ds.schedules.render import ascii_timeline
from megatron_ds.schedules.simulate import piecewise
from megatron_ds.schedules.timeline import RankTrace, measure, median_costs, to_schedule

# A MoE step whose all-to-all is 30 % of the work: per 1F1B stage F = 0.7 compute + 0.3 all-to-all,
# BW = 1.4 + 0.6 (B 0.7 + 0.6, W 0.7): 0.9 of 3.0.
MOE30 = dict(tf=0.7, tb=0.7, tw=0.7, all_to_all=(0.3, 0.6))


def one_rank(overlap, costs=MOE30, **kw):
    """p=1, m=2 under 1F1B: F0, then F1 and BW0 (a unit when `overlap`), then BW1."""
    s = build_schedule("1f1b", 1, 2, overlap=overlap)
    return s, simulate(s, **costs, **kw)


def test_plain_schedules_export_as_before_and_an_overlapped_one_round_trips(tmp_path):
    plain = build_schedule("dualpipev", 4, 8)
    assert plain.overlap is None and "overlap" not in plain.to_dict()
    assert list(plain.to_dict()) == ["schedule", "pp", "micro_batches", "replicas", "stages", "seq_splits",
                                     "placement", "ranks"]
    s = build_schedule("dualpipev", 4, 8, overlap=True)
    assert [op for ops in s.ranks for op in ops] == [op for ops in plain.ranks for op in ops]  # the same order
    d = json.loads(s.to_json(indent=2))
    assert d["overlap"] == s.overlap and Schedule.from_json(s.to_json()) == s
    path = tmp_path / "dpv.json"
    path.write_text(s.to_json(indent=2))
    assert from_file.for_run(str(path), 4, 8) == s


def test_dualpipev_pairs_are_the_references_overlapped_chunks():
    """Steps 4 and 5 of DualPipeV: m-2p+r+1 times (F0&BW1, F1&BW0), the last rank's first F0, BW1 apart;
    p-r-1 times BW1, (F1&BW0). p=4, m=8: rank r holds 2(r+1) + 3-r units, the last rank one fewer."""
    s = build_schedule("dualpipev", 4, 8, overlap=True)
    assert [len(row) for row in s.overlap] == [5, 6, 7, 7]
    lines = order_text(s).splitlines()
    assert lines[0].endswith("F3' F7+BW3' F4'+BW0 BW4' F5'+BW1 BW5' F6'+BW2 BW6' F7'+BW3 BW7' B4 W4 B5 W5 B6 W6 B7 W7")
    assert lines[3].startswith("rank3: F0 F0' F1 F1' F2 F2' F3 F3' F4 BW0' F4'+BW0 F5+BW1' F5'+BW1")


@pytest.mark.parametrize("name,knobs", [("1f1b", {}), ("interleaved", {"virtual_stages": 2}),
                                        ("interleaved", {"virtual_stages": 3}), ("interleaved", {}),
                                        ("dualpipev", {})])
@pytest.mark.parametrize("pp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 5, 8, 16, 24])
def test_every_overlapped_order_is_valid(name, knobs, pp, m):
    try:
        s = build_schedule(name, pp, m, overlap=True, **knobs)  # build_schedule validates
    except ScheduleError as exc:
        assert "virtual_stages" in str(exc) or "needs" in str(exc)  # the plain schedule's own checks
        return
    for r, a, b in s.pairs():
        assert {a.kind, b.kind} == {"F", "BW"} and a.unit != b.unit


def test_1f1b_overlapped_warms_up_two_more_per_rank_upstream():
    """Rank r runs 2(p-1-r)+1 forwards first, then (F, BW) units; its peak holds one more than its warm-up
    (the unit's forward allocates before its backward frees)."""
    s = build_schedule("1f1b", 4, 8, overlap=True)
    assert order_text(s).splitlines()[3] == "rank3: F0 F1+BW0 F2+BW1 F3+BW2 F4+BW3 F5+BW4 F6+BW5 F7+BW6 BW7"
    assert order_text(s).splitlines()[1] == "rank1: F0 F1 F2 F3 F4 F5+BW0 F6+BW1 F7+BW2 BW3 BW4 BW5 BW6 BW7"
    res = simulate(s, act_size=(1.0, 0.0))
    assert res.peak_memory == [8, 6, 4, 2]


def test_a_unit_takes_both_computes_and_what_neither_hides():
    """t = cF + cB + max(0, aF - cB) + max(0, aB - cF) + hF + hB, by hand on one rank (F0 alone first: 1.0)."""
    s, plain = one_rank(False)
    assert plain.makespan == pytest.approx(1.0 + 1.0 + 2.0 + 2.0)
    s, res = one_rank(True)
    f1, bw0 = s.ranks[0][1], s.ranks[0][2]
    assert res.start[f1] == res.start[bw0] == pytest.approx(1.0)
    assert res.end[f1] == res.end[bw0] == pytest.approx(1.0 + 0.7 + 1.4)  # both all-to-alls hidden
    assert res.makespan == pytest.approx(1.0 + 2.1 + 2.0)
    assert res.all_to_all_hidden == [pytest.approx(0.9)] and res.busy == [pytest.approx(5.1)]
    # all-to-alls longer than the other side's compute: F's 1.0 hides under BW's 1.4; BW's 2.0 only 0.7 of it
    _, res = one_rank(True, dict(tf=0.7, tb=0.7, tw=0.7, all_to_all=(1.0, 2.0)))
    assert res.end[f1] - res.start[f1] == pytest.approx(0.7 + 1.4 + 0.0 + 1.3)
    assert res.all_to_all_hidden == [pytest.approx(1.0 + 0.7)]
    # host time per side of a unit, on top
    _, res = one_rank(True, overlap_host=0.25)
    assert res.end[f1] - res.start[f1] == pytest.approx(2.1 + 0.5) and res.overlap_host == [pytest.approx(0.5)]
    # no all-to-all: nothing to hide, the unit is never shorter than the two ops one after the other
    _, res = one_rank(True, dict(tf=0.7, tb=0.7, tw=0.7))
    assert res.end[f1] - res.start[f1] == pytest.approx(0.7 + 1.4)


def test_1f1b_at_30_percent_all_to_all_by_hand():
    """p=2, m=4. Plain 1F1B: (m+p-1)(F+BW) = 5 x 3 = 15. Overlapped (a unit 2.1): rank 0 F0 F1 F2 to 3;
    rank 1 F0 1-2, F1+BW0 2-4.1, F2+BW1 4.1-6.2; rank 0 F3+BW0 4.1-6.2; rank 1 F3+BW2 6.2-8.3; rank 0 BW1
    6.2-8.2, BW2 8.3-10.3; rank 1 BW3 8.3-10.3; rank 0 BW3 10.3-12.3: three units on the critical path
    each hide 0.9."""
    plain = simulate(build_schedule("1f1b", 2, 4), **MOE30)
    over = simulate(build_schedule("1f1b", 2, 4, overlap=True), **MOE30)
    assert plain.makespan == pytest.approx(15.0)
    assert over.makespan == pytest.approx(12.3) == pytest.approx(plain.makespan - 3 * 0.9)


def test_dualpipev_at_30_percent_all_to_all_by_hand():
    """p=2, m=4, a chunk op half a stage's: F 0.35 + 0.15, BW 0.7 + 0.3, B 0.35 + 0.3, W 0.35; a unit
    F&BW 0.35 + 0.7 = 1.05. Up to rank 0's F1' (3.5) and rank 1's BW0' (3.0-4.0) both orders agree. Then
    rank 0: F3+BW1' 3.5-4.55 (F1' local), F2'+BW0 5.05-6.1 (rank 1's F2'+BW0 4.0-5.05), BW2' 6.1-7.1,
    F3'+BW1 7.15-8.2 (rank 1's F3'+BW1 6.1-7.15), BW3' 8.2-9.2, B2 9.2-9.85, W2 -10.2, B3 10.5-11.15 (rank
    1's B3 9.85-10.5), W3 -11.5. Plain: 12.8 (the same steps with every F and BW apart)."""
    plain = simulate(build_schedule("dualpipev", 2, 4), **MOE30)
    over = simulate(build_schedule("dualpipev", 2, 4, overlap=True), **MOE30)
    assert plain.makespan == pytest.approx(12.8) and over.makespan == pytest.approx(11.5)
    s = over.schedule
    ops = {s.op_label(0, op): op for op in s.ranks[0]}
    assert (over.start[ops["F3"]], over.end[ops["BW1'"]]) == (pytest.approx(3.5), pytest.approx(4.55))
    assert (over.start[ops["F2'"]], over.end[ops["BW0"]]) == (pytest.approx(5.05), pytest.approx(6.1))


@pytest.mark.parametrize("name,knobs", [("1f1b", {}), ("interleaved", {"virtual_stages": 2}), ("dualpipev", {})])
def test_overlap_pays_at_30_percent_and_not_without_an_all_to_all(name, knobs):
    pp, m = 4, 16
    plain, over = (build_schedule(name, pp, m, overlap=o, **knobs) for o in (False, True))
    assert simulate(over, **MOE30).makespan < 0.85 * simulate(plain, **MOE30).makespan
    dense = dict(tf=1.0, tb=1.0, tw=1.0)
    assert simulate(over, **dense).makespan >= simulate(plain, **dense).makespan - 1e-9


def test_the_host_time_is_per_piece_of_each_stage():
    """ModelCosts: a MoE layer runs PIECES_MOE pieces per side, a dense one 1; 1f1b p=2 over 4 layers, the
    first MoE: stage 0 holds 4 + 1 pieces, stage 1 two dense layers."""
    costs = ModelCosts.of_layers([(1, 1, 1)] * 4, 2, all_to_all=((0.1, 0.2), (0, 0), (0, 0), (0, 0)),
                                 piece_host=0.01)
    s = build_schedule("1f1b", 2, 4, overlap=True)
    assert costs.pieces_per_stage(s) == [PIECES_MOE + 1, 2]
    assert [len(row) for row in s.overlap] == [1, 3]
    # each unit pairs a forward and a backward of its rank's stage: both sides pay that stage's pieces
    assert evaluate(s, costs).overlap_host == [pytest.approx(1 * 2 * 5 * 0.01), pytest.approx(3 * 2 * 2 * 0.01)]


def _edit(s: Schedule, **kw) -> dict:
    d = s.to_dict()
    d.update(kw)
    return d


@pytest.mark.parametrize("overlap,line", [
    ([[0], []], "overlap: rank 0 position 0: F(r0,s0,mb0,q0) and F(r0,s0,mb1,q0) are no forward and backward"),
    ([[], [0]], "overlap: rank 1 position 0: F(r0,s1,mb0,q0) and BW(r0,s1,mb0,q0) depend on each other"),
    ([[3, 4], []], "op #4 is already in the unit at position 3"),
    ([[7], []], "overlap: rank 0 position 7 names no pair of ops"),
    ([[3]], "overlap has 1 rows for pp=2"),
], ids=["two-forwards", "same-unit", "op-twice", "out-of-range", "rows"])
def test_the_validator_refuses_a_broken_unit(overlap, line):
    s = build_schedule("1f1b", 2, 4)  # rank 0: F0 F1 BW0 F2 BW1 F3 BW2 BW3; rank 1: F0 BW0 F1 BW1 ...
    with pytest.raises(ScheduleError) as err:
        validate(Schedule.from_dict(_edit(s, overlap=overlap)))
    assert line in str(err.value)


def test_a_unit_waiting_on_itself_through_another_rank_is_a_deadlock():
    """Rank 0 runs F1+BW0 as a unit (1F1B's order) and rank 1, with one more warm-up forward, F1+BW0 too:
    rank 1's unit needs rank 0's F1, inside rank 0's unit, which needs rank 1's BW0: a cycle."""
    s = build_schedule("1f1b", 2, 4)
    d = _edit(s, ranks=[[o.to_dict() for o in s.ranks[0]],
                        [Op(k, 0, 1, mb).to_dict() for k, mb in
                         [("F", 0), ("F", 1), ("BW", 0), ("F", 2), ("BW", 1), ("F", 3), ("BW", 2), ("BW", 3)]]],
              overlap=[[1], [1]])
    with pytest.raises(ScheduleError, match="deadlock: rank 0 waits at BW.r0,s0,mb0,q0. for BW.r0,s1,mb0,q0. on "
                                            "rank 1; rank 1 waits at F.r0,s1,mb1,q0. for F.r0,s0,mb1,q0. on rank 0"):
        validate(Schedule.from_dict(d))


def test_schedule_json_overlap_must_be_lists_of_positions():
    with pytest.raises(ScheduleError, match="must be one list of op positions per rank"):
        Schedule.from_dict(_edit(build_schedule("1f1b", 2, 2), overlap=[[True], []]))


def test_only_the_schedules_with_an_overlapped_order_take_it():
    assert takes("overlap") == ["1f1b", "interleaved", "dualpipev"]
    with pytest.raises(ScheduleError, match="zbv does not take overlap=True: it has no overlapped order; "
                                            "overlapped forward-and-backward units apply to 1f1b, interleaved"):
        build_schedule("zbv", 4, 8, overlap=True)
    with pytest.raises(ScheduleError, match="not placed around overlapped units yet"):
        build_schedule("1f1b", 4, 8, overlap=True, vocab_parallel=True)


def test_the_ascii_timeline_draws_a_unit_as_one_bar():
    _, res = one_rank(True)
    assert ascii_timeline(res, width=51) == "rank0  |F0-------|F1+BW0--------------|BW1----------------"


def test_the_picture_draws_both_halves(tmp_path):
    pytest.importorskip("matplotlib")
    from megatron_ds.schedules.render import halves, plot_timeline
    s = build_schedule("dualpipev", 2, 4, overlap=True)
    assert halves(s, 0) == {s.ranks[0][i + k]: (-1 if s.ranks[0][i + k].kind == "F" else 1)
                            for i in s.overlap[0] for k in (0, 1)}
    path = plot_timeline(simulate(s, **MOE30), str(tmp_path / "dpv.png"))
    assert (tmp_path / "dpv.png").stat().st_size > 1000 and path.endswith("dpv.png")


def _trace(rank, events):
    meta = {"rank": rank, "stage_id": rank, "schedule": "1f1b", "pp": 2, "micro_batches": 2, "replicas": 1,
            "stages": 2, "seq_splits": 1, "placement": [[0, 1]], "dp": 1}
    out = []
    for (kind, mb, start, end, flagged) in events:
        args = {"kind": kind, "replica": 0, "stage": rank, "mb": mb, "seq": 0, **({"overlapped": True} if flagged else {})}
        out.append({"ph": "X", "cat": "compute", "name": f"{kind}{mb}", "ts": start, "dur": end - start,
                    "args": args})
    return RankTrace(meta, out)


def test_a_trace_of_overlapped_units_reads_back_as_them():
    """The two events of a unit span it and carry "overlapped": the executed order keeps the unit, busy time
    counts its span once, and the op medians leave its events out."""
    traces = [_trace(0, [("F", 0, 0.0, 1.0, False), ("F", 1, 1.0, 4.0, True), ("BW", 0, 1.0, 4.0, True),
                         ("BW", 1, 4.0, 6.0, False)]),
              _trace(1, [("F", 0, 1.0, 2.0, False), ("BW", 0, 2.0, 3.0, False), ("F", 1, 3.0, 4.0, False),
                         ("BW", 1, 4.0, 5.0, False)])]
    s = to_schedule(traces)
    assert s.overlap == [[1], []] and order_text(s).splitlines()[0] == "rank0: F0 F1+BW0 BW1"
    assert measure(traces).busy == [pytest.approx(6.0), pytest.approx(4.0)]
    assert median_costs(traces)["BW"] == pytest.approx(1.0)  # of 2, 1, 1 (with the unit's 3: 1.5)


def test_no_unit_is_the_schedule_without_the_field():
    s = build_schedule("dualpipev", 4, 2, overlap=True)  # m=2 < p: no steady state, so no unit
    assert s.overlap is None and s == build_schedule("dualpipev", 4, 2)


def test_the_cli_exports_and_shows_the_overlapped_order(capsys):
    from megatron_ds.schedules.cli import main
    assert main(["export", "--schedule", "dualpipev", "--pp", "2", "--micro-batches", "4", "--overlap"]) == 0
    assert Schedule.from_json(capsys.readouterr().out) == build_schedule("dualpipev", 2, 4, overlap=True)
    assert main(["show", "--schedule", "1f1b", "--pp", "2", "--micro-batches", "4", "--tf", "0.7", "--tb", "0.7",
                 "--tw", "0.7", "--all-to-all", "0.3,0.6", "--overlap", "--overlap-host", "0.05"]) == 0
    out = capsys.readouterr().out
    assert "|F3+BW0" in out and "makespan 12.600" in out  # 12.3 and three units' 2 x 0.05 on the path
    assert main(["show", "--schedule", "zbv", "--pp", "2", "--micro-batches", "4", "--overlap"]) == 2


def test_a_unit_piece_by_piece_by_hand():
    """piecewise: F (c 0.6, a 0.4 in 2 all-to-alls: pieces of 0.2, all-to-alls of 0.2) first, BW (c 0.9, a 0.6 in
    1: pieces of 0.45). F 0-0.2 issues (due 0.4); BW 0.2-0.65 issues (due 1.25); F 0.65-0.85 issues (due 1.05);
    BW waits to 1.25, 1.25-1.7, ends; F 1.7-1.9. Both in flight at once over 0.85-1.05; the two ops alone: 2.5."""
    assert piecewise([(0.6, 0.4, 2), (0.9, 0.6, 1)]) == pytest.approx(1.9)
    # without all-to-alls the sides run one after the other
    assert piecewise([(0.6, 0.0, 0), (0.9, 0.0, 0)]) == pytest.approx(1.5)
    # a side with an all-to-all but no count waits on it as the plain op does
    assert piecewise([(0.6, 0.4, 0), (0.9, 0.0, 0)]) == pytest.approx(1.9)
    # all-to-alls much longer than the pieces: the unit is about the longer side's chain of them, not their sum
    assert piecewise([(0.0, 3.0, 3), (0.0, 2.0, 2)]) == pytest.approx(3.0)


def test_the_simulator_runs_units_piece_by_piece_given_the_counts():
    """One rank, 1f1b overlapped, m=2 (F0, F1+BW0, BW1): with all_to_all_count the unit's span is piecewise's and
    what it hid its two ops' times less that span; ModelCosts gives the counts (3 per MoE layer's F, 2 per B)."""
    s = build_schedule("1f1b", 1, 2, overlap=True)
    unit = next(u for u in s.units(0) if len(u) == 2)
    res = simulate(s, 0.7, 0.7, 0.7, all_to_all=(0.3, 0.6), all_to_all_count=(3, 2))
    first, second = ((0.7, 0.3, 3), (1.4, 0.6, 2)) if unit[0].kind == "F" else ((1.4, 0.6, 2), (0.7, 0.3, 3))
    span = piecewise([first, second])
    assert res.end[unit[0]] - res.start[unit[0]] == pytest.approx(span)
    assert res.all_to_all_hidden == [pytest.approx(0.7 + 1.4 + 0.3 + 0.6 - span)]
    costs = ModelCosts.of_layers([(1, 1, 1)] * 4, 2, all_to_all=((0.1, 0.2), (0, 0), (0.1, 0.2), (0.1, 0.2)))
    assert costs.all_to_all_count_per_stage(build_schedule("1f1b", 2, 4)) == ([3, 6], [2, 4])
    assert costs.all_to_all_args(build_schedule("1f1b", 2, 4))["all_to_all_count"] == ([3, 6], [2, 4])
