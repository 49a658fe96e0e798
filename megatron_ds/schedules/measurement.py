"""What "auto" measured, as the simulator takes it (pure data; pipe/auto.py does the timing).

The timing window gives, per stage, each op kind's time on one micro-batch at one or two op sizes
(whole, or cut into k Seq1F1B segments), the runtime's time between ops, and, from the traces,
when each message was sent and when its receiver could start. `separate` splits an op's time into
a fixed part and a per-token part, `message_latencies` reads the p2p time off the traces,
`calibrate` adds what the simulator still misses per op (the traced makespans against the
simulated ones), and `model_costs` states it all as the simulator's ModelCosts. Under vocabulary
parallelism the embedding and the head are no part of the end stages: their costs are the
vocabulary passes' own times (`with_vocab`).
"""
from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass

from .costs import ModelCosts, evaluate
from .deps import UnitIndex
from .ir import Schedule
from .kinds import VOCAB_PASSES


@dataclass(frozen=True)
class Measured:
    """Per stage, the time of F, B and W on one whole micro-batch less the fixed part every op
    pays (seconds); that fixed part per op of each kind, `op_overhead`; and the p2p time."""
    f: list
    b: list
    w: list
    p2p: float = 0.0
    op_overhead: tuple = (0.0, 0.0, 0.0)
    op_sizes: tuple = (1,)  # the segment counts the micro-batches were timed at
    op_residual: float = 0.0  # of op_overhead, what `calibrate` added
    head_share: float = 0.0  # of the loss stage's time, the head + loss's by FLOPs (with no interior stage)
    vocab: tuple = ()  # vocabulary parallelism: per slice, EF, S, T and EW on one micro-batch less their fixed part


def separate(totals: dict, gap: float = 0.0, p2p: float = 0.0) -> Measured:
    """Measured from per-stage micro-batch times {k: (f, b, w)} taken with the micro-batch cut into k
    ops: T_k = T + k*c per stage, so two op sizes give each kind's fixed time c (median over the
    stages, never below 0) and the rest T. With one size c is unknown and taken as 0. `gap`, the
    runtime's time between ops, is added to every kind's c."""
    ks = sorted(totals)
    lo, hi = ks[0], ks[-1]
    out, fixed = [], []
    for i in range(3):
        c = 0.0
        if hi != lo:
            c = max(0.0, statistics.median((x - y) / (hi - lo) for x, y in zip(totals[hi][i], totals[lo][i])))
        out.append([max(0.0, t - lo * c) for t in totals[lo][i]])
        fixed.append(c + gap)
    return Measured(*out, p2p=p2p, op_overhead=tuple(fixed), op_sizes=tuple(ks))


def with_vocab(measured: Measured, slices: dict, k: int) -> Measured:
    """`measured` with the vocabulary passes' times: `slices` maps each pass's kind name to the median
    over the slices of one micro-batch's time in k ops; each less the fixed part those ops pay (the
    kind's cost in F, B and W times measured.op_overhead, as the simulator charges it)."""
    out = []
    for kind in VOCAB_PASSES:
        fixed = sum(c * o for c, o in zip(kind.traits.cost, measured.op_overhead))
        out.append(max(0.0, slices[kind.name] - k * fixed))
    return dataclasses.replace(measured, vocab=tuple(out))


def message_latencies(schedule: Schedule, timed: dict) -> list:
    """The p2p latencies one traced iteration shows: `timed` maps each op of `schedule` that ran
    (on the ranks of one pipeline replica, one host's clock) to (start, end, wait start or None).
    An op that waited on a message from the moment `wait start` until it began counts when its
    sender finished after the wait had begun: then start - the sender's end is what the message
    took, wake-up included (simulate's p2p_latency; a ping-pong of hot ranks sees less)."""
    index = UnitIndex(schedule)
    out = []
    for op, (start, _, waited_from) in timed.items():
        if waited_from is None or op not in index.where:
            continue
        senders = [timed[d][1] for d in index.deps(op) if d in timed and index.is_message(d, op)]
        if senders and max(senders) > waited_from:
            out.append(start - max(senders))
    return out


def ops_per_rank(schedule: Schedule) -> int:
    return max(len(ops) for ops in schedule.ranks)


def calibrate(measured: Measured, pp: int, runs: list, cuts: tuple = ()) -> Measured:
    """`measured` with what the simulator still misses per op added to every op's fixed time.
    `runs`: (schedule, makespan) of the timed iterations, the makespan traced (first op's start
    to last op's end). With two op counts per rank among them (the start-up schedule and its
    probe), the traced-less-simulated residual that grows with the ops per rank, b per op
    (never below 0), is what the op times alone do not show (on CPU ranks: each wake-up on a
    message; jitter that a lockstep order accumulates). Otherwise `measured` as it is."""
    costs, shares = model_costs(measured, pp), {c.k: c.costs for c in cuts}
    residuals = {}
    for schedule, makespan in runs:
        sim = evaluate(schedule, costs, p2p_latency=measured.p2p, seq_costs=shares.get(schedule.seq_splits))
        residuals.setdefault(ops_per_rank(schedule), []).append(makespan - sim.makespan)
    if len(residuals) < 2:
        return measured
    lo, hi = min(residuals), max(residuals)
    b = max(0.0, (statistics.median(residuals[hi]) - statistics.median(residuals[lo])) / (hi - lo))
    return dataclasses.replace(measured, op_overhead=tuple(c + b for c in measured.op_overhead), op_residual=b)


def head_share(head_layers: float, num_layers: int, stages: int) -> float:
    """The head + loss's share of the loss stage's time when it costs `head_layers` transformer layers
    and the stage holds its 1/stages of `num_layers` layers."""
    return head_layers / (num_layers / stages + head_layers) if head_layers > 0 else 0.0


def model_costs(measured: Measured, pp: int) -> ModelCosts:
    """ModelCosts from per-stage times of equal layer counts: the layers cost what the interior
    stages cost, the ends' excess is the embedding's (stage 0) and the LM head + loss's (last stage).
    With no interior stage (two stages) the last stage's `head_share` is the head's, the rest its
    layers' (without a share: the cheaper end stage is taken as layers alone). Under vocabulary
    parallelism (measured.vocab) the embedding and the head cost what p slices' passes do: EF is the
    embedding's forward, EW its backward, S the head's forward with its input gradient, T its weight
    gradient (kinds.py's costs)."""
    stages = len(measured.f)
    body, embed, head = [], [], []
    for times in (measured.f, measured.b, measured.w):
        if stages <= 2 and measured.head_share > 0:
            inner = [times[-1] * (1 - measured.head_share)]
        else:
            inner = times[1:-1] or [min(times[0], times[-1])]
        layer = statistics.median(inner)
        body.append(layer * stages / pp)  # one 1F1B stage holds stages/pp of these
        embed.append(max(0.0, times[0] - layer))
        head.append(max(0.0, times[-1] - layer))
    if measured.vocab:
        ef, s, t, ew = (x * pp for x in measured.vocab)
        embed, head = [ef, ew, 0.0], [s, 0.0, t]
    return ModelCosts(*body, embed=tuple(embed), head=tuple(head), op_overhead=tuple(measured.op_overhead))
