"""BitPipe (Wu et al. 2024): two V-shaped pipelines in opposite directions on the same ranks.

Replica 0 runs down the ranks and back (V), replica 1 is its mirror image. Micro-batches go
to the replicas in blocks of p/2 (mb 0..p/2-1 down, p/2..p-1 up, ...); p micro-batches form
one basic unit. Within a unit each rank runs its forwards in the order of the reference
implementation, and its backwards in the mirrored order (each forward replaced by the
backward of the other chunk of the same replica on that rank). The two orders are merged
by list scheduling against nominal costs (chunk BW = 2 chunk F): for one unit this gives
exactly the reference op order, and across units it joins them without draining the
pipeline, at least as tightly as the paper's B1 F5 F6 B2 junction. When m is not a multiple
of p the last unit is partial: its first p/2 micro-batches go down, the rest up, in the
full unit's order with the missing micro-batches left out.
"""
from __future__ import annotations

from ..kinds import BW, F
from ..ir import Op, Schedule, ScheduleError
from .. import placement
from .greedy import merge_queues


def check(pp: int, m: int) -> None:
    if pp % 2:
        raise ScheduleError(f"bitpipe needs an even pipeline size (pp={pp})")


def _unit_forwards(pp: int, rank: int, unit: int, place: list[list[int]]) -> list[Op]:
    half = pp // 2
    own = rank // half   # ranks in the lower half start with the down replica, upper with up
    other = 1 - own
    # How many of its own replica's forwards a rank runs before the other replica's arrive.
    lead = half - rank if rank < half else rank - half + 1

    def legs(rep: int) -> tuple[int, int]:
        first, second = [s for s, r in enumerate(place[rep]) if r == rank]
        return first, second

    def ops(rep: int, second: bool) -> list[Op]:
        stage = legs(rep)[1 if second else 0]
        return [Op(F, rep, stage, unit * pp + rep * half + i) for i in range(half)]

    own1, own2, oth1, oth2 = ops(own, False), ops(own, True), ops(other, False), ops(other, True)
    out = own1[:lead]
    for i in range(half - lead):
        out += [oth1[i], own1[i + lead]]
    for i in range(lead):
        out += [oth1[i + half - lead], oth2[i]]
    for i in range(half - lead):
        out += [own2[i], oth2[i + lead]]
    out += own2[half - lead:]
    return out


def bitpipe(pp: int, m: int) -> Schedule:
    place = placement.bitpipe(pp)
    stages = 2 * pp
    skeleton = Schedule("bitpipe", pp, m, 2, stages, 1, place, [])
    forwards, backwards, caps = [], [], []
    for r in range(pp):
        fwd = [op for u in range(-(-m // pp)) for op in _unit_forwards(pp, r, u, place) if op.mb < m]
        forwards.append(fwd)
        backwards.append([Op(BW, op.replica, stages - 1 - op.stage, op.mb) for op in fwd])
        # The reference warm-up (3p/2 forwards at the ends, up to 2p-1 in the middle) plus
        # the one forward of the first 1F1B pair: the unit's own peak, kept for all units.
        caps.append(pp + pp // 2 + min(r, pp - 1 - r) + 1)
    nominal = lambda op: 1.0 if op.kind == F else 2.0  # noqa: E731
    skeleton.ranks = merge_queues(skeleton, forwards, backwards, nominal, caps)
    return skeleton
