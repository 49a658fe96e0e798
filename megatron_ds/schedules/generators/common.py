"""Building blocks shared by the generators."""
from __future__ import annotations

from collections import deque
from typing import Callable, Sequence

from ..kinds import ACT, B, BW, GRAD, W
from ..ir import Op


def one_f_one_b(forwards: Sequence[Op], backwards: Sequence[Op], warmup: int) -> list[Op]:
    """`warmup` forwards, then alternate one forward and one backward, then drain the backwards."""
    warmup = min(warmup, len(forwards))
    out = list(forwards[:warmup])
    fwd = deque(forwards[warmup:])
    bwd = deque(backwards)
    while fwd:
        out.append(fwd.popleft())
        if bwd:
            out.append(bwd.popleft())
    out.extend(bwd)
    return out


def split_weights(ops: Sequence[Op], keep_pending: int | Callable[[int], int]) -> list[Op]:
    """Turn every BW into B and defer its W, keeping at most `keep_pending` W's waiting.

    Deferring W's lets a rank start the next input-gradient backward (which the previous
    rank waits on) sooner; the W's it holds back are run where it would otherwise idle.
    `keep_pending` may depend on how many backwards have run so far.
    """
    limit = keep_pending if callable(keep_pending) else (lambda _n, k=keep_pending: k)
    out: list[Op] = []
    pending: deque[Op] = deque()
    n_back = 0
    for op in ops:
        if op.kind != BW:
            out.append(op)
            continue
        out.append(Op(B, op.replica, op.stage, op.mb, op.seq))
        pending.append(Op(W, op.replica, op.stage, op.mb, op.seq))
        n_back += 1
        while len(pending) > max(0, limit(n_back)):
            out.append(pending.popleft())
    out.extend(pending)
    return out


def units(mbs: Sequence[int], k: int, *, reverse_seq: bool = False) -> list[tuple[int, int]]:
    """(mb, seq) work units in order: micro-batches in the given order, segments 0..k-1
    (or k-1..0 for backwards, whose gradients flow from later segments to earlier ones)."""
    segs = range(k - 1, -1, -1) if reverse_seq else range(k)
    return [(mb, q) for mb in mbs for q in segs]


def paired_one_f_one_b(forwards: Sequence[Op], backwards: Sequence[Op], warmup: int) -> tuple[list[Op], list[int]]:
    """one_f_one_b, and the positions of its steady state's (forward, backward) pairs, each to run as one
    overlapped unit (Megatron's combined 1F1B). `warmup` must leave the paired ops independent: a rank's
    warm-up two forwards longer than the next rank's lets each unit wait for that rank's unit of the
    same step and its own unit two steps back, as plain 1F1B's steady state waits for one op."""
    out = one_f_one_b(forwards, backwards, warmup)
    return out, overlap_positions(out, zip(out[min(warmup, len(forwards))::2],
                                           out[min(warmup, len(forwards)) + 1::2]))


def overlap_positions(ops: Sequence[Op], pairs) -> list[int]:
    """The positions i of `ops` where (ops[i], ops[i+1]) is one of `pairs` and is a forward with a backward
    (Schedule.overlap's row); a pair whose ops are not next to each other is left out."""
    wanted = {(a, b) for a, b in pairs}
    out, i = [], 0
    while i < len(ops) - 1:
        a, b = ops[i], ops[i + 1]
        if (a, b) in wanted and {a.kind.traits.consumes, b.kind.traits.consumes} == {ACT, GRAD}:
            out.append(i)
            i += 2
        else:
            i += 1
    return out
