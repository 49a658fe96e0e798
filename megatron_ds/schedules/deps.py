"""The dependency rules of the IR, shared by the validator, the simulator and the renderer."""
from __future__ import annotations

from .ir import Op, Schedule
from .kinds import ACT, EF, GRAD, S, F


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
        self.shards = range(schedule.pp) if schedule.vocab_parallel else range(0)
        self._deps: dict[Op, list[Op]] = {}

    def deps(self, op: Op) -> list[Op]:
        """The ops `op` must wait for (only those the schedule contains)."""
        found = self._deps.get(op)
        if found is None:
            found = self._deps[op] = self._find_deps(op)
        return found

    def _find_deps(self, op: Op) -> list[Op]:
        rep, s, mb, q = op.unit
        traits = op.kind.traits
        if traits.vocab:
            return self._vocab_deps(op)
        want: list[Op] = []
        if traits.consumes == ACT:  # the previous stage's and the earlier segment's forwards
            if s > 0:
                want.append(Op(F, rep, s - 1, mb, q))
            else:  # the embedding's output: the sum of every slice's rows
                want.extend(Op(EF, rep, j, mb, q) for j in self.shards)
            if q > 0:
                want.append(Op(F, rep, s, mb, q - 1))
        elif traits.consumes == GRAD:  # its own forward, the next stage's and the later segment's backwards
            want.append(Op(F, rep, s, mb, q))
            nxt = self.backward.get((rep, s + 1, mb, q))
            if nxt is not None:
                want.append(nxt)
            elif s == self.schedule.loss_stage:  # the loss stage's output gradient: the all-reduced S passes
                want.extend(Op(S, rep, j, mb, q) for j in self.shards)
            later = self.backward.get((rep, s, mb, q + 1))
            if later is not None:
                want.append(later)
        if traits.after is not None:
            want.append(Op(traits.after, rep, s, mb, q))
        return want

    def _vocab_deps(self, op: Op) -> list[Op]:
        """EF reads only token ids. S reads the last stage's output (broadcast to every rank). T needs
        the softmax statistics all-reduced over every slice's S. EW needs stage 0's input gradient
        (broadcast from the rank of stage 0)."""
        rep, _, mb, q = op.unit
        if op.kind is S:
            return [Op(F, rep, self.schedule.loss_stage, mb, q)]
        if op.kind.traits.vocab == "head":
            return [Op(S, rep, j, mb, q) for j in self.shards]
        if op.kind is EF:
            return []
        return [self.backward[(rep, 0, mb, q)]]

    def is_message(self, dep: Op, op: Op) -> bool:
        """True when the edge dep -> op crosses ranks and so becomes a p2p send/recv."""
        return self.where[dep][0] != self.where[op][0]
