"""What "auto" measured, as the simulator takes it (pure data; pipe/auto.py does the timing).

The timing window gives, per stage, each op kind's time on one micro-batch at one or two op sizes
(whole, or cut into k Seq1F1B segments), the runtime's time between ops, and, from the traces,
when each message was sent and when its receiver could start. `separate` splits an op's time into
a fixed part and a per-token part, `message_latencies` reads the p2p time off the traces,
`calibrate` adds what the simulator still misses per op (the traced makespans against the
simulated ones), and `model_costs` states it all as the simulator's ModelCosts. Under vocabulary
parallelism the embedding and the head are no part of the end stages: their costs are the
vocabulary passes' own times (`with_vocab`).

A mixture of experts (`Measured.layer_kinds` names each stage's MoE layers): a MoE layer costs more
than a dense one, so where the timed stages hold them in different mixes `model_costs` tells the two
apart and states every layer's own cost (ModelCosts.layers), for candidates that cut the layers
otherwise. The expert-parallel all-to-all was timed inside the ops apart from their compute
(`Measured.all_to_all`): it is stated per MoE layer as its own quantity (ModelCosts.all_to_all).
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
    layer_kinds: tuple = ()  # per stage, a 0/1 per transformer layer it holds (1: a MoE layer); (): a dense model
    moe_flops: float = 1.0  # a MoE layer's forward FLOPs over a dense one's (when the stages cannot tell them apart)
    all_to_all: tuple = ()  # per stage, (F, B) seconds of the expert-parallel all-to-all in one micro-batch's ops,
    # which f and b do not hold (the runtime's op times less it)
    piece_host: float = 0.0  # host seconds per piece of an overlapped unit (ModelCosts.piece_host)


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


def _layer_split(counts: list, times: list, moe_flops: float) -> tuple:
    """(a dense layer's time, a MoE layer's) from stages of (dense, MoE) layer counts and their layers'
    times: least squares where the stages hold two mixes that are not multiples of each other, else
    their time shared by FLOPs (a MoE layer costs `moe_flops` dense ones), the median over stages."""
    rows = [(d, e, t) for (d, e), t in zip(counts, times) if d + e]
    sdd, see, sde = (sum(a * b for a, b in pairs) for pairs in
                     ([(d, d) for d, _, _ in rows], [(e, e) for _, e, _ in rows], [(d, e) for d, e, _ in rows]))
    det = sdd * see - sde * sde
    if det > 1e-9 * max(sdd * see, 1.0):
        sdt, set_ = sum(d * t for d, _, t in rows), sum(e * t for _, e, t in rows)
        dense, moe = (see * sdt - sde * set_) / det, (sdd * set_ - sde * sdt) / det
        if dense >= 0 and moe >= 0:
            return dense, moe
    dense = statistics.median(t / (d + moe_flops * e) for d, e, t in rows) if rows else 0.0
    return dense, moe_flops * dense


def moe_costs(measured: Measured, pp: int) -> ModelCosts:
    """model_costs of a MoE model: the layers' times from the interior stages' (or as model_costs without
    them), dense and MoE layers told apart (`_layer_split`); the ends' excess over their own layers the
    embedding's and the head's; the all-to-all per MoE layer the median over the stages that hold MoE
    layers of their all-to-all time per MoE layer."""
    kinds = measured.layer_kinds
    counts = [(len(k) - sum(k), sum(k)) for k in kinds]
    comm = list(measured.all_to_all) or [(0.0, 0.0)] * len(kinds)
    stages, layers, embed, head = len(kinds), [], [], []
    for compute in (measured.f, measured.b, measured.w):
        if stages <= 2 and measured.head_share > 0:
            inner = [(counts[-1], compute[-1] * (1 - measured.head_share))]
        elif stages > 2:
            inner = list(zip(counts[1:-1], compute[1:-1]))
        else:  # the cheaper end stage taken as layers alone
            inner = [min(zip(counts, compute), key=lambda ct: ct[1])]
        dense, moe = _layer_split([c for c, _ in inner], [t for _, t in inner], measured.moe_flops)
        layers.append([moe if flag else dense for k in kinds for flag in k])
        own = [d * dense + e * moe for d, e in counts]
        embed.append(max(0.0, compute[0] - own[0]))
        head.append(max(0.0, compute[-1] - own[-1]))
    per_moe = [statistics.median(c[i] / e for c, (_, e) in zip(comm, counts) if e) if any(e for _, e in counts)
               else 0.0 for i in range(2)]
    all_to_all = tuple((per_moe[0], per_moe[1]) if flag else (0.0, 0.0) for k in kinds for flag in k)
    if measured.vocab:
        ef, s, t, ew = (x * pp for x in measured.vocab)
        embed, head = [ef, ew, 0.0], [s, 0.0, t]
    return ModelCosts.of_layers(zip(*layers), pp, embed=tuple(embed), head=tuple(head),
                                op_overhead=tuple(measured.op_overhead),
                                all_to_all=all_to_all if any(any(t) for t in all_to_all) else ())


def model_costs(measured: Measured, pp: int) -> ModelCosts:
    """ModelCosts from per-stage times of equal layer counts: the layers cost what the interior
    stages cost, the ends' excess is the embedding's (stage 0) and the LM head + loss's (last stage).
    With no interior stage (two stages) the last stage's `head_share` is the head's, the rest its
    layers' (without a share: the cheaper end stage is taken as layers alone). Under vocabulary
    parallelism (measured.vocab) the embedding and the head cost what p slices' passes do: EF is the
    embedding's forward, EW its backward, S the head's forward with its input gradient, T its weight
    gradient (kinds.py's costs). A MoE model: `moe_costs`."""
    if any(any(k) for k in measured.layer_kinds):
        return moe_costs(measured, pp)
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
