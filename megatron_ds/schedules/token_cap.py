"""Seq1F1B under a token cap: no rank holds more tokens' activations than under 1F1B.

With unequal segments (the FLOP-balanced split makes the first ones longest) plain
Seq1F1B can hold more than 1F1B on the last ranks: rank p-1 holds k segments, and after
B(mb, k-1) F(mb+1, 0) those are segments 0..k-2 of one micro-batch and the long segment 0
of the next (at p=4, k=4, seq 2048: 2416 tokens, 1.18 micro-batches). `cap_tokens` moves
backward ops ahead of a forward, in their own order and only once their forward has run,
until the forward fits under the rank's 1F1B amount, (p - r) micro-batches (one chunk per
rank). Forwards keep their order and slots, so nothing another rank waits for comes later
than a backward it would anyway wait behind. The seq1f1b generator applies it when it is given
the segment lengths (the engine's plan gives them), so every reader of the schedule sees the
capped order.
"""
from __future__ import annotations

from typing import Sequence

from .ir import Schedule
from .kinds import Kind
from .validate import validate


def cap_rank(ops: list, lengths: Sequence[int], cap: int) -> list:
    """`ops` with B/BW ops pulled ahead of each F that would otherwise hold more than `cap` tokens."""
    backward = [op for op in ops if op.kind in (Kind.B, Kind.BW)]
    out, forwarded, held, nxt = [], set(), 0, 0

    def ready():
        return nxt < len(backward) and (backward[nxt].mb, backward[nxt].seq) in forwarded

    for op in ops:
        if op.kind is Kind.F:
            while held + lengths[op.seq] > cap and ready():
                out.append(backward[nxt])
                held -= lengths[backward[nxt].seq]
                nxt += 1
            out.append(op)
            held += lengths[op.seq]
            forwarded.add((op.mb, op.seq))
        elif op.kind in (Kind.B, Kind.BW):
            if ready():  # else already pulled ahead: the next one waits for its own slot or a forward
                out.append(backward[nxt])
                held -= lengths[backward[nxt].seq]
                nxt += 1
        else:
            out.append(op)
    return out + backward[nxt:]


def cap_tokens(schedule: Schedule, lengths: Sequence[int]) -> Schedule:
    """The Seq1F1B `schedule` (one chunk per rank) with every rank capped at its 1F1B token count."""
    if schedule.stages != schedule.pp or schedule.replicas != 1 or len(lengths) != schedule.seq_splits:
        return schedule
    seq = sum(lengths)
    schedule.ranks = [cap_rank(ops, lengths, (schedule.pp - r) * seq) for r, ops in enumerate(schedule.ranks)]
    validate(schedule)
    return schedule
