"""Seq1F1B (Sun et al., NAACL 2025): 1F1B over (micro-batch, segment) units.

Each micro-batch's sequence is cut into k segments. Forwards run segments 0..k-1 (a segment
attends to the keys/values of the earlier ones); backwards take micro-batches oldest first
but, within one, the last segment first, because earlier segments' K/V gradients come from
later segments. Rank r warms up with p-r-1 + k-1 units, then runs 1F1B. With v > 1 the
units follow the interleaved order (Seq1F1B-I); with split_backward the backward is split
into B and W with rank r holding back up to r W's as in ZB-H1 (no public code ships this).

Given `segment_lengths` (tokens per segment) that differ, as the FLOP-balanced split's do, the
order is capped so that no rank holds more tokens' activations than under 1F1B
(schedules/token_cap.py): the engine runs exactly this order, so the CLI, the simulator and
the JSON export (which then carries "segment_lengths") show it too.
"""
from __future__ import annotations

from typing import Sequence

from ..kinds import BW, F
from ..ir import Op, Schedule, ScheduleError
from .. import placement
from ..token_cap import cap_tokens
from .common import one_f_one_b, split_weights, units
from .interleaved import interleaved


def seq1f1b(pp: int, m: int, *, seq_splits: int = 1, virtual_stages: int = 1,
            split_backward: bool = False, segment_lengths: Sequence[int] | None = None) -> Schedule:
    k, v = seq_splits, virtual_stages
    if segment_lengths is not None and (len(segment_lengths) != k or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in segment_lengths)):
        raise ScheduleError(f"seq1f1b segment_lengths={list(segment_lengths)}: give seq_splits={k} positive "
                            "token counts")
    fwd_units = units(range(m), k)
    bwd_units = units(range(m), k, reverse_seq=True)
    if v > 1:
        sched = interleaved(pp, m, v, k=k, name="seq1f1b", fwd_units=fwd_units,
                            bwd_units=bwd_units)
    else:
        ranks = []
        for r in range(pp):
            fwd = [Op(F, 0, r, mb, q) for mb, q in fwd_units]
            bwd = [Op(BW, 0, r, mb, q) for mb, q in bwd_units]
            ranks.append(one_f_one_b(fwd, bwd, pp - r - 1 + k - 1))
        sched = Schedule("seq1f1b", pp, m, 1, pp, k, placement.linear(pp), ranks)
    if split_backward:
        # Hold back as many W's as ZB-H1 does per rank, counted in chunks of this rank.
        sched.ranks = [split_weights(ops, r * v) for r, ops in enumerate(sched.ranks)]
    if segment_lengths is not None:
        sched = cap_tokens(sched, segment_lengths)
        sched.segment_lengths = list(segment_lengths)
    return sched
