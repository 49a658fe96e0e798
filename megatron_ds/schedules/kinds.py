"""The op kinds of the IR and what each one does, in one table.

F is the forward, B the input-gradient backward, W the weight-gradient backward (a B's
deferred half) and BW the fused backward, as in the Zero Bubble paper. Under vocabulary
parallelism ("Balancing Pipeline Parallelism with Vocabulary Parallelism", Yeung et al., MLSys
2025) every pipeline rank also holds a 1/p slice of the vocabulary, of the input embedding and of
the output layer, and runs four more kinds on it, per micro-batch (and segment): EF (its rows of
the embedding lookup, summed over the ranks into stage 0's input), S (the paper's S pass: its
slice of the logits, their max and sum of exp, the target's logit, and its share of the input
gradient, computed with the slice's own softmax and rescaled once the all-reduce of the
statistics is done), T (the paper's T pass: its slice's weight gradient, once the statistics
are all-reduced) and EW (its embedding rows' weight gradient, from stage 0's input gradient).
A vocabulary op's `stage` names its slice, which lives on the pipeline rank of that number. The dependency rules,
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
    EF = "EF"
    S = "S"
    T = "T"
    EW = "EW"

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
    # "head" or "embed" for the vocabulary kinds: their cost multiplies that layer's whole-vocabulary
    # (F, B, W) times over p slices, and their memory (+1 allocates, -1 frees) counts one slice of a
    # micro-batch's logits. None: a transformer-stage kind.
    vocab: Optional[str] = None


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
    # Vocabulary passes: greys and purples, so the transformer's colours keep their meaning.
    Kind.EF: Traits(None, None, None, (1, 0, 0), (0, 0), ("#d9d9d9",) * 4, "embedding slice forward", "embed"),
    Kind.S: Traits(None, None, None, (1, 1, 0), (1, 0), ("#bcbddc",) * 4,
                   "output-layer slice: logits, softmax statistics, input-gradient share (S pass)", "head"),
    Kind.T: Traits(None, None, None, (0, 0, 1), (-1, 0), ("#756bb1",) * 4,
                   "output-layer slice weight gradient (T pass)", "head"),
    Kind.EW: Traits(None, None, None, (0, 1, 1), (0, 0), ("#969696",) * 4,
                    "embedding slice weight gradient", "embed"),
}

F, B, W, BW = Kind.F, Kind.B, Kind.W, Kind.BW
EF, S, T, EW = Kind.EF, Kind.S, Kind.T, Kind.EW
VOCAB = frozenset(k for k in Kind if k.traits.vocab)   # the kinds every rank runs on its vocabulary slice
VOCAB_PASSES = (EF, S, T, EW)   # the same, in the order measurement.Measured.vocab holds their times
# The kinds one work unit (replica, stage, mb, seq) must run: a forward and a fused backward,
# or a forward and a split one.
COMPLETE = (frozenset({F, BW}), frozenset({F, B, W}))
