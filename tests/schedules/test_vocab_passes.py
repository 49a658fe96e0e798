"""The vocabulary kinds in the IR: JSON, dependency rules, validator, simulator costs and memory."""
import json

import pytest

from megatron_ds.schedules import Op, Schedule, ScheduleError, build_schedule, simulate, validate
from megatron_ds.schedules.kinds import VOCAB


def _hand(vocab=True):
    """1F1B at p=2, m=1 with each rank's slice passes: the smallest vocabulary-parallel schedule."""
    r0 = [Op("EF", 0, 0, 0), Op("F", 0, 0, 0), Op("S", 0, 0, 0), Op("T", 0, 0, 0), Op("BW", 0, 0, 0),
          Op("EW", 0, 0, 0)]
    r1 = [Op("EF", 0, 1, 0), Op("F", 0, 1, 0), Op("S", 0, 1, 0), Op("BW", 0, 1, 0), Op("T", 0, 1, 0),
          Op("EW", 0, 1, 0)]
    return Schedule("hand", 2, 1, 1, 2, 1, [[0, 1]], [r0, r1], vocab_parallel=vocab)


def test_hand_schedule_runs_and_each_rule_binds():
    s = _hand()
    validate(s)
    res = simulate(s, tf=1, tb=1, tw=1, head=(2.0, 4.0, 6.0), embed=(1.0, 2.0, 0.0))
    t = {op: (res.start[op], res.end[op]) for op in res.start}
    # EF: 1/2 of the embedding's F; S: 1/2 of the head's F + B; T: 1/2 of its W; EW: 1/2 of the embedding's B + W
    assert t[Op("EF", 0, 0, 0)] == (0, 0.5)
    assert t[Op("F", 0, 0, 0)] == (0.5, 1.5)          # after both slices' EF
    assert t[Op("F", 0, 1, 0)] == (1.5, 2.5)
    assert t[Op("S", 0, 0, 0)] == (2.5, 5.5)          # S waits for the last stage's forward
    assert t[Op("BW", 0, 1, 0)] == (5.5, 7.5)         # the loss stage's backward waits for every S
    assert t[Op("T", 0, 0, 0)] == (5.5, 8.5)          # T too (the all-reduced statistics)
    assert t[Op("BW", 0, 0, 0)] == (8.5, 10.5)
    assert t[Op("EW", 0, 1, 0)] == (10.5, 11.5)       # EW after stage 0's input gradient
    assert res.makespan == 11.5


def test_json_carries_vocab_parallel_and_old_files_stay_valid():
    s = _hand()
    d = json.loads(s.to_json(indent=2))
    assert d["vocab_parallel"] is True and [o["op"] for o in d["ranks"][0]] == ["EF", "F", "S", "T", "BW", "EW"]
    assert Schedule.from_json(s.to_json()).ranks == s.ranks and Schedule.from_json(s.to_json()).vocab_parallel
    plain = build_schedule("1f1b", 2, 2)
    assert "vocab_parallel" not in plain.to_dict() and not Schedule.from_json(plain.to_json()).vocab_parallel
    with pytest.raises(ScheduleError, match="vocab_parallel='yes'"):
        Schedule.from_dict({**d, "vocab_parallel": "yes"})


@pytest.mark.parametrize("edit, words", [
    (lambda s: setattr(s, "vocab_parallel", False), "without vocab_parallel"),
    (lambda s: s.ranks[1].remove(Op("T", 0, 1, 0)), "vocabulary slice 1, mb 0, seq 0) has no T"),
    (lambda s: s.ranks[0].insert(0, s.ranks[1].pop(0)), "vocabulary slice 1 lives on rank 1"),
    (lambda s: s.ranks[1].insert(2, s.ranks[1].pop(3)), "runs BW(r0,s1,mb0,q0) (op #2) before its dependency S"),
    (lambda s: s.ranks[0].insert(2, s.ranks[0].pop(3)), "runs T(r0,s0,mb0,q0) (op #2) before its dependency S"),
])
def test_validator_names_the_broken_vocabulary_rule(edit, words):
    s = _hand()
    edit(s)
    with pytest.raises(ScheduleError) as err:
        validate(s)
    assert words in str(err.value)


def test_the_barrier_deadlock_is_reported_as_a_cycle():
    s = _hand()
    s.ranks[0] = [Op("EF", 0, 0, 0), Op("F", 0, 0, 0), Op("BW", 0, 0, 0), Op("S", 0, 0, 0), Op("T", 0, 0, 0),
                  Op("EW", 0, 0, 0)]   # rank 0's S after its backward, which waits for rank 1's, which waits for S
    with pytest.raises(ScheduleError, match="deadlock: .*waits at BW"):
        validate(s)


def test_logits_memory_naive_on_the_loss_stage_sliced_with_vocab_parallel():
    naive = simulate(build_schedule("1f1b", 2, 2), head_memory=4.0)
    # rank 1 holds one micro-batch's activations and its logits at once; rank 0 two micro-batches, no logits
    assert naive.peak_memory == [2.0, 5.0]
    # ZB-H1's rank 1 runs F0 B0 F1 W0 B1 W1: a held-back W keeps its logits' gradient, so two are held
    split = simulate(build_schedule("zb-h1", 2, 2), head_memory=4.0)
    assert split.peak_memory[1] == pytest.approx(1.0 + 4.0 - 0.5 + 1.0 + 4.0)
    vp = simulate(_hand(), head_memory=4.0)
    assert vp.peak_memory == [1.0 + 2.0, 1.0 + 2.0]   # each rank holds its slice, S to T


@pytest.mark.parametrize("name, kw", [("1f1b", {}), ("interleaved", {"virtual_stages": 2}), ("zb-h1", {}),
                                      ("zb-h2", {}), ("zbv", {}), ("zbv-half", {}), ("zbv-min", {}),
                                      ("seq1f1b", {"seq_splits": 2, "split_backward": True}), ("gpipe", {}),
                                      ("bitpipe", {}), ("dualpipev", {})])
def test_every_catalogued_schedule_carries_the_passes(name, kw):
    s = build_schedule(name, 4, 8, vocab_parallel=True, **kw)   # validated by build_schedule
    k = s.seq_splits
    for r, ops in enumerate(s.ranks):
        vocab = [op for op in ops if op.kind in VOCAB]
        assert len(vocab) == 4 * 8 * k and {op.stage for op in vocab} == {r}
    # the transformer ops are the schedule's own, each rank's in an order of its own
    own = build_schedule(name, 4, 8, **kw)
    assert [sorted(map(str, (op for op in ops if op.kind not in VOCAB))) for ops in s.ranks] == \
        [sorted(map(str, ops)) for ops in own.ranks]
