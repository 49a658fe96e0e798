"""Vocabulary parallelism's messages (pipe/plan/vocab_messages.py in the MessagePlan): exactly the
dependencies of the vocabulary passes that cross ranks, each from the rank that computes it to the
rank that waits for it; evaluation's fewer."""
import pytest

from megatron_ds.pipe.plan.messages import MessagePlan, lookahead, reads
from megatron_ds.pipe.plan.vocab_messages import EGRAD, EMB, HID, SHARE, STAT, width
from megatron_ds.schedules import build_schedule
from megatron_ds.schedules.deps import UnitIndex
from megatron_ds.schedules.kinds import EF, F, S


def sent(plan):
    """{(src, dst, what, replica, mb, seq)} of a MessagePlan."""
    return {(src, dst, key[0], key[1], key[3], key[4]) for (src, dst), keys in plan.sends.items() for key in keys}


@pytest.mark.parametrize("name,knobs", [("1f1b", {}), ("zbv", {}), ("seq1f1b", {"seq_splits": 2})])
def test_messages_are_the_dependencies_that_cross_ranks(name, knobs):
    s = build_schedule(name, 4, 4, vocab_parallel=True, **knobs)
    index = UnitIndex(s)
    crossing = {(index.where[dep][0], r, dep.replica, dep.mb, dep.seq)
                for r, _, op in s.ops() for dep in index.deps(op) if index.where[dep][0] != r}
    messages = sent(MessagePlan(s, s.ranks))
    assert {m[:2] + m[3:] for m in messages} == crossing
    loss_rank = s.rank_of(0, s.loss_stage)
    assert {m[2] for m in messages} == {"act", "grad", EMB, HID, STAT, SHARE, EGRAD}
    assert {m[1] for m in messages if m[2] == SHARE} == {loss_rank}  # only the loss stage merges the shares
    assert {m[1] for m in messages if m[2] == EMB} == {s.rank_of(0, 0)}


def test_evaluation_sends_the_statistics_to_the_loss_stage_only():
    s = build_schedule("1f1b", 4, 4, vocab_parallel=True)
    forwards = [[op for op in ops if op.kind in (F, EF, S)] for ops in s.ranks]
    messages = sent(MessagePlan(s, forwards, train=False))
    assert {m[2] for m in messages} == {"act", EMB, HID, STAT}
    assert {m[1] for m in messages if m[2] == STAT} == {3}
    assert width((STAT, 0, 1, 0, 0), 32) == 3 and width((SHARE, 0, 1, 0, 0), 32) == 64 and width(("act",), 32) == 32


def test_receives_posted_ahead_are_messages_to_the_rank_that_a_later_op_reads():
    s = build_schedule("zbv", 4, 4, vocab_parallel=True)
    plan, read = MessagePlan(s, s.ranks), reads(s)
    for rank, ops in enumerate(s.ranks):
        mine = {key for (_, dst), keys in plan.sends.items() if dst == rank for key in keys}
        ahead = lookahead(ops, {key for key, src in plan.source.items() if src != rank}, read)
        assert any(key[0] == STAT for keys in ahead.values() for key in keys)
        for i, op in enumerate(ops):
            later = {key for nxt in ops[i + 1:] for key in read(nxt)}
            assert set(ahead.get(op, ())) <= mine & later, (rank, op)
