"""Message planning: what each rank receives, in which order, and which receive it posts ahead."""
from megatron_ds.pipe.plan.messages import MessagePlan, incoming_key, lookahead, outgoing
from megatron_ds.schedules.kinds import ACT, GRAD
from megatron_ds.schedules import Op, build_schedule


def test_each_op_posts_the_next_receiving_ops_message():
    sched = build_schedule("1f1b", 2, 3)
    plan = MessagePlan(sched, sched.ranks)
    last = sched.ranks[1]  # F0 BW0 F1 BW1 F2 BW2: every F receives an activation, no BW receives
    ahead = lookahead(last, plan.source)
    assert last[0] == Op("F", 0, 1, 0) and ahead[last[0]] == [(ACT, 0, 0, 1, 0)]
    assert ahead[last[1]] == [(ACT, 0, 0, 1, 0)]  # BW0 posts F1's activation, F1 then posts F2's
    assert ahead[last[2]] == [(ACT, 0, 0, 2, 0)]
    assert last[-1] not in ahead and last[-2] not in ahead  # nothing left to receive after F2
    first = sched.ranks[0]
    ahead0 = lookahead(first, plan.source)
    receivers = [op for op in first if incoming_key(op) in plan.source]
    assert [op.kind for op in receivers] == ["BW"] * 3
    assert all(ahead0[op] == [incoming_key(nxt)] for op, nxt in zip(receivers, receivers[1:]))


def test_messages_are_planned_in_the_senders_order():
    sched = build_schedule("zbv", 2, 4)
    plan = MessagePlan(sched, sched.ranks)
    for (src, dst), keys in plan.sends.items():
        sent = [outgoing(sched, src, op) for op in sched.ranks[src]]
        assert [key for key, to in filter(None, sent) if to == dst] == keys
        assert {plan.source[k] for k in keys} == {src}
    assert any(k[0] == GRAD for keys in plan.sends.values() for k in keys)



def test_lookahead_never_points_back_at_a_consumed_message():
    for name, p, m in [("zbv", 4, 8), ("zb-h2", 4, 8), ("bitpipe", 4, 8), ("interleaved", 4, 8)]:
        kw = {"virtual_stages": 2} if name == "interleaved" else {}
        sched = build_schedule(name, p, m, **kw)
        plan = MessagePlan(sched, sched.ranks)
        for ops in sched.ranks:
            ahead, consumed = lookahead(ops, plan.source), set()
            for op in ops:
                assert not consumed.intersection(ahead.get(op, ())), (name, op)
                if incoming_key(op) in plan.source:
                    consumed.add(incoming_key(op))
        assert incoming_key(Op("W", 0, 1, 0)) is None
