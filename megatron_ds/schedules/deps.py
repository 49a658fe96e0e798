"""The dependency rules of the IR, shared by the validator, the simulator and the renderer."""
from __future__ import annotations

from .ir import Op, Schedule
from .kinds import ACT, GRAD, F


class UnitIndex:
    """Finds, for one schedule, the op that does each kind of work on each unit.

    B and BW both produce the input gradient (they send GRAD), so "the backward" of a unit is
    whichever of them the schedule uses; that is what the next-lower stage and the earlier
    segment wait on.
    """

    def __init__(self, schedule: Schedule):
        self.schedule = schedule
        self.where: dict[Op, tuple[int, int]] = {}
        self.backward: dict[tuple, Op] = {}
        for r, i, op in schedule.ops():
            self.where.setdefault(op, (r, i))
            if op.kind.traits.sends == GRAD:
                self.backward.setdefault(op.unit, op)

    def deps(self, op: Op) -> list[Op]:
        """The ops `op` must wait for (only those the schedule contains)."""
        rep, s, mb, q = op.unit
        traits = op.kind.traits
        want: list[Op] = []
        if traits.consumes == ACT:  # the previous stage's and the earlier segment's forwards
            if s > 0:
                want.append(Op(F, rep, s - 1, mb, q))
            if q > 0:
                want.append(Op(F, rep, s, mb, q - 1))
        elif traits.consumes == GRAD:  # its own forward, the next stage's and the later segment's backwards
            want.append(Op(F, rep, s, mb, q))
            nxt = self.backward.get((rep, s + 1, mb, q))
            if nxt is not None:
                want.append(nxt)
            later = self.backward.get((rep, s, mb, q + 1))
            if later is not None:
                want.append(later)
        if traits.after is not None:
            want.append(Op(traits.after, rep, s, mb, q))
        return want

    def is_message(self, dep: Op, op: Op) -> bool:
        """True when the edge dep -> op crosses ranks and so becomes a p2p send/recv."""
        return self.where[dep][0] != self.where[op][0]
