"""The op kinds of the IR and what each one does, in one table.

F is the forward, B the input-gradient backward, W the weight-gradient backward (a B's
deferred half) and BW the fused backward, as in the Zero Bubble paper. The dependency rules,
the p2p plan, the simulator, the pictures and the engine read the traits below instead of
testing kind names, so a new kind (e.g. an overlapped F&B) is one entry here, one engine
handler and one instruction. A Kind is a str: the JSON export writes "F", "B", "W", "BW".
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Optional

ACT, GRAD = "act", "grad"   # the two messages: an activation goes up the stages, a gradient down


class Kind(StrEnum):
    F = "F"
    B = "B"
    W = "W"
    BW = "BW"

    @property
    def traits(self) -> "Traits":
        return TRAITS[self]


@dataclass(frozen=True)
class Traits:
    consumes: Optional[str]   # the message it reads: ACT from stage s-1, GRAD from stage s+1, or None
    sends: Optional[str]      # the message it produces: ACT for stage s+1, GRAD (input gradient) for s-1
    after: Optional[Kind]     # the op of the same unit it finishes (W: the B whose weight GEMMs it runs)
    cost: tuple               # its time as multiples of (TF, TB, TW)
    memory: tuple             # its activation-memory change as multiples of (M_B, M_W)
    colours: tuple            # picture colours, one shade per chunk of the rank (later chunks darker)
    meaning: str


# Forward blue, input-grad backward green, weight-grad orange, fused backward red.
TRAITS = {
    Kind.F: Traits(ACT, ACT, None, (1, 0, 0), (1, 0), ("#9ecae1", "#4292c6", "#2171b5", "#08519c"),
                   "forward"),
    Kind.B: Traits(GRAD, GRAD, None, (0, 1, 0), (-1, 1), ("#a1d99b", "#41ab5d", "#238b45", "#006d2c"),
                   "input-gradient backward"),
    Kind.W: Traits(None, None, Kind.B, (0, 0, 1), (0, -1), ("#fdd0a2", "#fd8d3c", "#e6550d", "#a63603"),
                   "weight-gradient backward"),
    Kind.BW: Traits(GRAD, GRAD, None, (0, 1, 1), (-1, 0), ("#fcbba1", "#fb6a4a", "#de2d26", "#a50f15"),
                    "fused backward"),
}

F, B, W, BW = Kind.F, Kind.B, Kind.W, Kind.BW
# The kinds one work unit (replica, stage, mb, seq) must run: a forward and a fused backward,
# or a forward and a split one.
COMPLETE = (frozenset({F, BW}), frozenset({F, B, W}))
