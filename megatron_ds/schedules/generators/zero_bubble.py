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
    # Rank r runs up to 2(p-r)-1 forwards before its first B, enough to cover the round
    # trip to the last rank, and W's where it would otherwise wait. Holding back up to 2r
    # W's lets the cool-down become a parallelogram while the peak stays 2p-1 micro-batches
    # on rank 0 for any m. Played out with W at half a forward (a typical ratio), the order
    # reaches the start-up bound m(TF+TB+TW) + (p-1)TF for both TW = TF and TW = TF/2.
    place = placement.linear(pp)
    skeleton = Schedule("zb-h2", pp, m, 1, pp, 1, place, [])
    fwd = [[Op(F, 0, r, mb) for mb in range(m)] for r in range(pp)]
    bwd = [[Op(B, 0, r, mb) for mb in range(m)] for r in range(pp)]
    wgt = [[Op(W, 0, r, mb) for mb in range(m)] for r in range(pp)]
    caps = [2 * (pp - r) - 1 for r in range(pp)]
    nominal = lambda op: 0.5 if op.kind == W else 1.0  # noqa: E731
    skeleton.ranks = merge_queues(skeleton, fwd, bwd, nominal, caps, weights=wgt,
                                  w_caps=[2 * r for r in range(pp)])
    # With few micro-batches (m < 2p or so) the long warm-up has nothing to overlap and
    # ZB-H1's order is shorter; never hand out a ZB-H2 that loses to it.
    h1 = zb_h1(pp, m)
    if _nominal_makespan(h1) < _nominal_makespan(skeleton):
        skeleton.ranks = h1.ranks
    return skeleton


def _nominal_makespan(schedule: Schedule) -> float:
    return sum(simulate(schedule, 1.0, 1.0, tw, check=False).makespan for tw in (1.0, 0.5))
