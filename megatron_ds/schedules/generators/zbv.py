"""ZB-V (Zero Bubble PP, arXiv 2401.10241 sec. 6): 2p stages in a V, rank r holds stages r
and 2p-1-r, so the embedding and the loss head share rank 0 and the turn of the V is a
local hand-over on rank p-1.

Rank r's order follows the paper's hand-made rule (also what PyTorch's
ScheduleZBVZeroBubble emits): warm-up of 2(p-r)-1 first-leg forwards, then r pairs of
(second-leg F, first-leg F), then p-r groups of second-leg (F, B, W); the steady phase
repeats first-leg (F, B, W) and second-leg (F, B, W); the cool-down runs r pairs of B's and
p-r first-leg (B, W), then the remaining W's. With m < 2p-1 the rule is played for 2p-1
micro-batches and the missing ones are dropped.

Few micro-batches leave that rule's warm-up with little to overlap, so the generator also
plays the same forward and backward orders out greedily (list scheduling, 2p chunk
activations at most, W's where a rank would idle) and keeps whichever order is shorter
for nominal costs without using more memory; for m >= 2p the rule wins.
"""
from __future__ import annotations

from ..kinds import B, F, W
from ..ir import Op, Schedule, ScheduleError
from .. import placement
from ..simulate import simulate
from .greedy import merge_queues


def _rank_order(pp: int, n: int, rank: int) -> list[tuple[str, int, int]]:
    """(kind, leg, index) triples; index counts that leg's ops of that kind."""
    count = {(k, leg): 0 for k in (F, B, W) for leg in (0, 1)}
    out: list[tuple[str, int, int]] = []

    def emit(kind: str, leg: int) -> None:
        out.append((kind, leg, count[kind, leg]))
        count[kind, leg] += 1

    for _ in range(2 * (pp - rank) - 1):
        emit(F, 0)
    for _ in range(rank):
        emit(F, 1)
        emit(F, 0)
    for _ in range(pp - rank):
        for kind in (F, B, W):
            emit(kind, 1)
    while count[F, 0] < n or count[F, 1] < count[F, 0]:
        if count[F, 0] < n:
            emit(F, 0)
        emit(B, 0)
        emit(W, 0)
        for kind in (F, B, W):
            emit(kind, 1)
    for _ in range(rank):
        emit(B, 0)
        emit(B, 1)
    for _ in range(pp - rank):
        emit(B, 0)
        emit(W, 0)
    while count[W, 1] < count[B, 1]:
        emit(W, 1)
    while count[W, 0] < count[B, 0]:
        emit(W, 0)
    return out


def _by_rule(pp: int, m: int) -> Schedule:
    place = placement.v_shape(pp)
    n = max(m, 2 * pp - 1)
    ranks = []
    for r in range(pp):
        stage = (r, 2 * pp - 1 - r)
        ranks.append([Op(kind, 0, stage[leg], i) for kind, leg, i in _rank_order(pp, n, r)
                      if i < m])
    return Schedule("zbv", pp, m, 1, 2 * pp, 1, place, ranks)


def _greedy(rule: Schedule) -> Schedule:
    pp = rule.pp
    fwd = [[op for op in ops if op.kind == F] for ops in rule.ranks]
    bwd = [[op for op in ops if op.kind == B] for ops in rule.ranks]
    wgt = [[Op(W, op.replica, op.stage, op.mb) for op in ops] for ops in bwd]
    out = Schedule("zbv", pp, rule.micro_batches, 1, rule.stages, 1, rule.placement, [])
    nominal = lambda op: 0.5 if op.kind == W else 1.0  # noqa: E731
    out.ranks = merge_queues(out, fwd, bwd, nominal, [2 * pp] * pp, weights=wgt,
                             w_caps=[pp] * pp)
    return out


def zbv(pp: int, m: int) -> Schedule:
    rule = _by_rule(pp, m)
    if m >= 2 * pp:
        return rule

    def score(s: Schedule) -> tuple[float, float]:
        runs = [simulate(s, 1.0, 1.0, tw, check=False) for tw in (1.0, 0.5)]
        return sum(r.makespan for r in runs), max(runs[0].peak_memory)

    best, alt = score(rule), None
    try:
        alt = _greedy(rule)
    except ScheduleError:  # a policy that stalls just loses the contest
        return rule
    alt_score = score(alt)
    return alt if alt_score[0] < best[0] and alt_score[1] <= best[1] else rule
