"""DualPipeV (DeepSeek-V3 report, deepseek-ai/DualPipe dualpipev.py) in the IR, with its B/W split.

Placement as ZB-V: rank r holds stage r (phase 0, activations flow down the ranks) and stage
2p-1-r (phase 1, back up), so rank 0 loads the data and computes the loss. Rank r runs the
reference's eight steps:
  1. 2(p-r-1) phase-0 forwards;  2. r+1 pairs (F0, F1);  3. p-r-1 times (B1, W, F1);
  4. m-2p+r+1 times (F0, BW1, F1, BW0), the steady state (the reference overlaps each F with
     the backward beside it: with `overlap`, overlapped units (F0, BW1) and (F1, BW0), but the last
     rank's first (F0, BW1), which the reference runs apart to shorten the bubble);
  5. p-r-1 times (BW1, F1, BW0), (F1, BW0) overlapped;  6. r+1 pairs of phase-1 and phase-0 backwards, the second
     half of them split into B and W;  7. p-r-1 times (W, B0);  8. the remaining W's.
A W runs the oldest deferred weight gradient of the rank (the reference's FIFO
WeightGradStore). DeepSpeed's DualPipeVSchedule runs the same steps without the split: every
backward is a full BW and the W slots are empty. The reference needs m >= 2p; with fewer
micro-batches the steps are played for 2p and the missing ones left out (as PyTorch pads its
ZB-V), which still beats 1F1B (p=4: m=2 12.5 against 15, m=4 16.5 against 21 units).
"""
from __future__ import annotations

from collections import deque

from ..ir import Op, Schedule
from .. import placement
from .common import overlap_positions


def _rank_ops(pp: int, m: int, rank: int, pairs: list | None = None) -> list[Op]:
    """Rank `rank`'s ops; `pairs` (a list) receives the (forward, backward) pairs the reference overlaps."""
    stage = (rank, 2 * pp - 1 - rank)
    count = {"F": [0, 0], "B": [0, 0]}
    held: deque[Op] = deque()
    out: list[Op] = []
    pairs = [] if pairs is None else pairs

    def paired() -> None:  # the last two ops, a forward and a backward: one overlapped chunk of the reference
        pairs.append((out[-2], out[-1]))

    def forward(phase: int) -> None:
        out.append(Op("F", 0, stage[phase], count["F"][phase]))
        count["F"][phase] += 1

    def backward(phase: int, split: bool = False) -> None:
        mb = count["B"][phase]
        count["B"][phase] += 1
        out.append(Op("B" if split else "BW", 0, stage[phase], mb))
        if split:
            held.append(Op("W", 0, stage[phase], mb))

    def weight() -> None:
        out.append(held.popleft())

    for _ in range(2 * (pp - rank - 1)):
        forward(0)
    for _ in range(rank + 1):
        forward(0)
        forward(1)
    for _ in range(pp - rank - 1):
        backward(1, split=True)
        weight()
        forward(1)
    for i in range(m - 2 * pp + rank + 1):
        forward(0)
        backward(1)
        if i > 0 or rank < pp - 1:  # the last rank runs its first two apart, to shorten the bubble (reference)
            paired()
        forward(1)
        backward(0)
        paired()
    for _ in range(pp - rank - 1):
        backward(1)
        forward(1)
        backward(0)
        paired()
    split, steps = False, rank + 1
    for i in range(steps):
        if i == steps // 2 and rank % 2 == 1:
            split = True
        backward(1, split)
        if i == steps // 2 and rank % 2 == 0:
            split = True
        backward(0, split)
    for _ in range(pp - rank - 1):
        weight()
        backward(0, split=True)
    while held:
        weight()
    return out


def dualpipev(pp: int, m: int, overlap: bool = False) -> Schedule:
    """`overlap`: the reference's overlapped chunks (each steady-state forward with the backward beside it,
    steps 4 and 5) as overlapped units; the op order is the same."""
    n = max(m, 2 * pp)
    ranks, rows = [], []
    for r in range(pp):
        pairs: list = []
        ops = [op for op in _rank_ops(pp, n, r, pairs) if op.mb < m]
        ranks.append(ops)
        rows.append(overlap_positions(ops, pairs))
    return Schedule("dualpipev", pp, m, 1, 2 * pp, 1, placement.v_shape(pp), ranks,
                    overlap=rows if overlap else None)
