"""GPipe and 1F1B (DeepSpeed's TrainSchedule order): stage r on rank r, fused backward."""
from __future__ import annotations

from ..kinds import BW, F
from ..ir import Op, Schedule
from .. import placement
from .common import one_f_one_b, paired_one_f_one_b


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


def one_f_one_b_overlapped(pp: int, m: int, name: str = "1f1b") -> Schedule:
    """1F1B whose steady state runs each forward with the backward after it as one overlapped unit
    (Megatron's combined 1F1B). Rank r warms up with 2(p-1-r)+1 forwards: the last rank's one keeps
    the paired ops of other micro-batches, and two more per rank upstream keep every rank busy (with
    plain 1F1B's one more, each unit would wait for the next rank's unit, which waits for it)."""
    ranks, overlap = [], []
    for r in range(pp):
        fwd = [Op(F, 0, r, mb) for mb in range(m)]
        bwd = [Op(BW, 0, r, mb) for mb in range(m)]
        ops, pairs = paired_one_f_one_b(fwd, bwd, 2 * (pp - 1 - r) + 1)
        ranks.append(ops)
        overlap.append(pairs)
    return Schedule(name, pp, m, 1, pp, 1, placement.linear(pp), ranks, overlap=overlap)
