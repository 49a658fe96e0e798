"""ZB-V (Zero Bubble PP, arXiv 2401.10241 sec. 6): 2p stages in a V, rank r holds stages r
and 2p-1-r, so the embedding and the loss head share rank 0 and the turn of the V is a
local hand-over on rank p-1.

Rank r's order follows the paper's hand-made rule (also what PyTorch's
ScheduleZBVZeroBubble emits): warm-up of 2(p-r)-1 first-leg forwards, then r pairs of
(second-leg F, first-leg F), then p-r groups of second-leg (F, B, W); the steady phase
repeats first-leg (F, B, W) and second-leg (F, B, W); the cool-down runs r pairs of B's and
p-r first-leg (B, W), then the remaining W's. With m < 2p-1 the rule is played for 2p-1
micro-batches and the missing ones are dropped.
"""
from __future__ import annotations

from ..ir import Op, Schedule
from .. import placement


def _rank_order(pp: int, n: int, rank: int) -> list[tuple[str, int, int]]:
    """(kind, leg, index) triples; index counts that leg's ops of that kind."""
    count = {(k, leg): 0 for k in "FBW" for leg in (0, 1)}
    out: list[tuple[str, int, int]] = []

    def emit(kind: str, leg: int) -> None:
        out.append((kind, leg, count[kind, leg]))
        count[kind, leg] += 1

    for _ in range(2 * (pp - rank) - 1):
        emit("F", 0)
    for _ in range(rank):
        emit("F", 1)
        emit("F", 0)
    for _ in range(pp - rank):
        for kind in "FBW":
            emit(kind, 1)
    while count["F", 0] < n or count["F", 1] < count["F", 0]:
        if count["F", 0] < n:
            emit("F", 0)
        emit("B", 0)
        emit("W", 0)
        for kind in "FBW":
            emit(kind, 1)
    for _ in range(rank):
        emit("B", 0)
        emit("B", 1)
    for _ in range(pp - rank):
        emit("B", 0)
        emit("W", 0)
    while count["W", 1] < count["B", 1]:
        emit("W", 1)
    while count["W", 0] < count["B", 0]:
        emit("W", 0)
    return out


def zbv(pp: int, m: int) -> Schedule:
    place = placement.v_shape(pp)
    n = max(m, 2 * pp - 1)
    ranks = []
    for r in range(pp):
        stage = (r, 2 * pp - 1 - r)
        ranks.append([Op(kind, 0, stage[leg], i) for kind, leg, i in _rank_order(pp, n, r)
                      if i < m])
    return Schedule("zbv", pp, m, 1, 2 * pp, 1, place, ranks)
