"""ZB-H1 and ZB-H2 (Zero Bubble Pipeline Parallelism, ICLR 2024): 1F1B placement, backward
split into B (input gradient, on the critical path) and W (weight gradient, deferrable)."""
from __future__ import annotations

from ..kinds import B, F, W
from ..ir import Op, Schedule
from .. import placement
from ..simulate import simulate
from .basic import one_f_one_b_schedule
from .common import split_weights
from .greedy import merge_queues


def zb_h1(pp: int, m: int) -> Schedule:
    # 1F1B order with rank r holding back r W's: its backwards reach rank r-1 sooner, and
    # the held W's fill the cool-down. Memory stays 1F1B's (only M_W per held W).
    base = one_f_one_b_schedule(pp, m, name="zb-h1")
    base.ranks = [split_weights(ops, r) for r, ops in enumerate(base.ranks)]
    return base


def zb_h2(pp: int, m: int) -> Schedule:
    # The paper's parallelogram: rank r starts at r*TF and, at TF = TB = TW, is busy from its
    # first op to its last; the makespan is the start-up bound m(TF+TB+TW) + (p-1)TF. Rank r
    # runs forwards whenever its activations (a forward holds M_B until its B, M_W = M_B/2
    # until its W) stay within 2p-1 micro-batches, which is the warm-up 2(p-r)-1 forwards
    # deep that covers the round trip to the last rank; B's go first, W's fill the time a
    # rank would wait. Holding back up to p-1+r W's gives every rank enough W's to fill the
    # cool-down, where backwards arrive one per TB but only one W is freed per B.
    place = placement.linear(pp)
    skeleton = Schedule("zb-h2", pp, m, 1, pp, 1, place, [])
    fwd = [[Op(F, 0, r, mb) for mb in range(m)] for r in range(pp)]
    bwd = [[Op(B, 0, r, mb) for mb in range(m)] for r in range(pp)]
    wgt = [[Op(W, 0, r, mb) for mb in range(m)] for r in range(pp)]
    footprint = {F: 1.0, B: -0.5, W: -0.5}
    skeleton.ranks = merge_queues(skeleton, fwd, bwd, lambda _op: 1.0, [2 * pp - 1] * pp,
                                  weights=wgt, w_caps=[pp - 1 + r for r in range(pp)],
                                  footprint=footprint)
    # With few micro-batches (m < 2p or so) the long warm-up has nothing to overlap and
    # ZB-H1's order is shorter; never hand out a ZB-H2 that loses to it.
    h1 = zb_h1(pp, m)
    if _nominal_makespan(h1) < _nominal_makespan(skeleton):
        skeleton.ranks = h1.ranks
    return skeleton


def _nominal_makespan(schedule: Schedule) -> float:
    return sum(simulate(schedule, 1.0, 1.0, tw, check=False).makespan for tw in (1.0, 0.5))
