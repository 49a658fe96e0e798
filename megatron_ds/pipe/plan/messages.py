"""Point-to-point traffic derived from a schedule: who sends what to whom, in which order.

Pure data (no torch): the engine's P2P (p2p.py) executes this plan. An edge between two
stages on different ranks is a message: F(s) sends its activation to the rank of stage s+1,
B/BW(s) sends its input gradient to the rank of stage s-1. A receiver posts its irecvs in
the order the sender issues the sends (it knows the sender's op list), so messages between a
pair match in FIFO order on every backend - gloo's blocking rendezvous and NCCL's ordered
streams alike.

A send only moves once its receive is posted (gloo rendezvouses, NCCL's send waits for the
peer), so a receive posted when its op starts puts a round trip on the critical path. The
engine therefore posts each op's receive one op ahead, when the op before it starts
(`lookahead`): the data flows while that op computes, at the cost of one posted buffer per
source.
"""
from collections import defaultdict

from megatron_ds.schedules.kinds import ACT, GRAD

from .vocab_messages import vocab_incoming, vocab_outgoing

STEP = {ACT: 1, GRAD: -1}  # an activation goes to the next stage, a gradient to the previous one


def outgoing(schedule, rank, op):
    """(message key, destination rank) that `op` on `rank` sends, or None (nothing to send, the
    loss stage's activation or stage 0's gradient, or a local hand-over)."""
    what = op.kind.traits.sends
    if what is None or not 0 <= op.stage + STEP[what] <= schedule.loss_stage:
        return None
    dst = schedule.rank_of(op.replica, op.stage + STEP[what])
    return ((what, op.replica, op.stage, op.mb, op.seq), dst) if dst != rank else None


def message_key(op):
    """The key of the message `op` sends (see outgoing), whether it crosses ranks or not."""
    return (op.kind.traits.sends, op.replica, op.stage, op.mb, op.seq)


def incoming_key(op):
    """The message key `op` consumes: F(s) the activation of F(s-1), B/BW(s) the gradient of B(s+1);
    None for W, which works on what its B left behind."""
    what = op.kind.traits.consumes
    if what is None:
        return None
    return (what, op.replica, op.stage - STEP[what], op.mb, op.seq)


def lookahead(ops, remote_keys, reads=None):
    """{op: the keys of the messages the next receiving op after it reads}, of those in `remote_keys`.
    `reads(op)`: the keys op reads (default: its incoming_key). A key read twice on a rank (vocabulary
    parallelism's statistics, read by T and the loss stage's backward) arrives once, for its first reader."""
    reads = reads or (lambda op: [incoming_key(op)])
    seen, first_reads = set(), []
    for op in ops:
        keys = [key for key in reads(op) if key in remote_keys and key not in seen]
        seen.update(keys)
        first_reads.append(keys)
    ahead, following = {}, None
    for op, keys in zip(reversed(ops), reversed(first_reads)):
        if following is not None:
            ahead[op] = following
        if keys:
            following = keys
    return ahead


def all_outgoing(schedule, rank, op, train=True):
    """Every (key, destination rank) `op` on `rank` sends to another rank, in send order: its
    activation or gradient, and under vocabulary parallelism those of vocab_messages.py."""
    out = outgoing(schedule, rank, op)
    sends = [out] if out else []
    if schedule.vocab_parallel:
        sends += [(key, dst) for key, dst in vocab_outgoing(schedule, op, train) if dst != rank]
    return sends


def reads(schedule):
    """The keys an op reads, for lookahead: its incoming_key, and under vocabulary parallelism those of
    vocab_messages.vocab_incoming."""
    if not schedule.vocab_parallel:
        return None
    return lambda op: [incoming_key(op), *vocab_incoming(schedule, op)]


class MessagePlan:
    """For each (src, dst) pair, the messages src sends to dst, in src's op order. `train`: the op
    lists hold backwards (evaluation's vocabulary messages are fewer)."""

    def __init__(self, schedule, op_lists, train=True):
        self.schedule = schedule
        self.sends = defaultdict(list)  # (src, dst) -> [key, ...]
        self.source = {}  # key -> src rank
        for src, ops in enumerate(op_lists):
            for op in ops:
                for key, dst in all_outgoing(schedule, src, op, train):
                    self.sends[(src, dst)].append(key)
                    self.source[key] = src
