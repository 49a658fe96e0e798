"""GPipe and 1F1B (DeepSpeed's TrainSchedule order): stage r on rank r, fused backward."""
from __future__ import annotations

from ..kinds import BW, F
from ..ir import Op, Schedule
from .. import placement
from .common import one_f_one_b


def gpipe(pp: int, m: int) -> Schedule:
    ranks = [[Op(F, 0, r, mb) for mb in range(m)] + [Op(BW, 0, r, mb) for mb in range(m)]
             for r in range(pp)]
    return Schedule("gpipe", pp, m, 1, pp, 1, placement.linear(pp), ranks)


def one_f_one_b_schedule(pp: int, m: int, name: str = "1f1b") -> Schedule:
    ranks = []
    for r in range(pp):
        fwd = [Op(F, 0, r, mb) for mb in range(m)]
        bwd = [Op(BW, 0, r, mb) for mb in range(m)]
        # Rank r must have p-r-1 micro-batches in flight before its first backward can arrive.
        ranks.append(one_f_one_b(fwd, bwd, pp - r - 1))
    return Schedule(name, pp, m, 1, pp, 1, placement.linear(pp), ranks)
