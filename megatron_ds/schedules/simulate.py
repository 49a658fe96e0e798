"""Timing and memory model of a schedule: every rank runs its list in order, each op as soon as
its dependencies are done (plus a p2p latency when they ran on another rank).

Costs follow DESIGN.md: tf, tb, tw are the times of one op on one 1F1B stage (1/p of the
model, whole sequence). An op of a schedule with S stages per replica costs p/S of that, and a
sequence segment its share of the micro-batch (1/k, or seq_costs normalized). A cost given as
a list is per stage of the replica and used as is (to model e.g. a heavier loss stage).
`op_overhead` (F, B, W) is a fixed time every op pays whatever its size (launches, the runtime's
own work): it is what makes many small ops (segments, chunks) dearer than their share. A BW op costs
tb + tw, unless `tbw` gives its own time (as tf): a fused backward measured apart from a split one, which
costs more where the split is autograd's (pipe/foreign/autograd_split.py).

Activation memory, in units of one micro-batch's activations on one 1F1B stage: F holds M_B
until the input-gradient backward, which keeps M_W of it for W; BW frees all of it. A sequence
segment holds its tokens' share (1/k when the schedule does not carry its segment lengths).

The vocabulary layers: `head` and `embed` are the (F, B, W) times of the output layer with its
loss and of the input embedding over the whole vocabulary. Under vocab_parallel each rank's
vocabulary passes cost 1/p of them (S: the head's F + B, its input-gradient share being computed
in the S pass; T: its W; EF: the embedding's F; EW: its B + W, all of which is weight gradient).
Otherwise give them in the stages' costs (ModelCosts does). `head_memory` is what one
micro-batch's logits (and their gradient) hold, in the activation unit: without vocabulary
parallelism the loss stage's F allocates it and the op that ends that unit's backward (W, or BW)
frees it; with it, each S allocates 1/p of it and the T of that micro-batch frees it.

`all_to_all` (F, B) is communication inside the ops: a MoE layer's expert-parallel all-to-all, which
the runtime runs synchronously in the layer's forward (dispatch and combine) and input-gradient
backward (their reverse). It is time on the critical path of F and of B (or BW), given per stage as
tf is, and kept apart from the compute: SimResult.all_to_all is each rank's time in it, so a model
that overlaps it with other work (overlapped units) can take it off the ops instead. `stage_memory` scales
the activations of each stage of a replica over an even share's (1: the stage holds 1/S of the
model's; a stage of MoE layers holds more than one of dense layers). `transient` (op -> memory) is what an op
holds only while it runs, on top of the level before it: a recomputed layer's activations in B (recompute.py).

An overlapped unit (Schedule.overlap: a forward and a backward of two other units, DualPipe's overlapped chunk)
starts when both ops' inputs are there and ends, for both, when its last piece does. With `all_to_all_count`
(F, B: the all-to-alls inside each stage's ops, as all_to_all) it runs piece by piece as pipe/moe/overlap.py runs it
(`piecewise`): a side of k all-to-alls is k + 1 equal pieces of its compute and host time with an all-to-all of
a/k after each but the last; the unit's first op starts, each all-to-all issued hands over to the other side,
which waits on its own in-flight one before its next piece, so both sides' all-to-alls may be in flight at once.
Without counts, the closed form
    c_F + c_B + max(0, a_F - c_B) + max(0, a_B - c_F) + h_F + h_B
where c is an op's compute (with its fixed time), a its all-to-all and h the host time the unit's pieces add on
its stage (`overlap_host`, per side, as tf): each side's whole all-to-all behind the other side's whole compute.
SimResult.all_to_all_hidden is what the unit hid per rank (its ops' times one after the other less its span),
SimResult.overlap_host what the pieces cost. Its peak memory counts the forward's allocation before the
backward's release.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence, Union

from .deps import UnitIndex
from .ir import Op, Schedule, ScheduleError
from .kinds import Kind
from .validate import validate

Cost = Union[float, Sequence[float]]
ActSize = Union[None, float, tuple, Callable[[Op], tuple]]

DEFAULT_ACT = (1.0, 0.5)  # (M_B, M_W): W keeps the layer inputs, about half of M_B


@dataclass
class SimResult:
    schedule: Schedule
    start: dict[Op, float]
    end: dict[Op, float]
    makespan: float
    busy: list[float]            # compute time per rank
    bubble: list[float]          # (makespan - busy) / makespan per rank
    bubble_ratio: float          # max over ranks
    own_bubble: list[float]      # idle / span from the rank's own first op to its last (ZB paper's view)
    peak_memory: list[float]     # peak activation memory per rank
    p2p_messages: int            # cross-rank edges (activations down + gradients up)
    p2p_sent: list[int]          # messages sent per rank
    all_to_all: list[float] = field(default_factory=list)  # per rank, time in its ops' all-to-all (within busy)
    all_to_all_hidden: list[float] = field(default_factory=list)  # per rank, of it hidden in overlapped units
    overlap_host: list[float] = field(default_factory=list)   # per rank, host time its overlapped units add

    @property
    def peak_memory_max(self) -> float:
        return max(self.peak_memory)


def simulate(schedule: Schedule, tf: Cost = 1.0, tb: Cost = 1.0, tw: Cost = 1.0, *,
             p2p_latency: float = 0.0, seq_costs: Sequence[float] | None = None,
             act_size: ActSize = None, check: bool = True,
             op_overhead: tuple = (0.0, 0.0, 0.0), head: tuple = (0.0, 0.0, 0.0),
             embed: tuple = (0.0, 0.0, 0.0), head_memory: float = 0.0, all_to_all: tuple | None = None,
             stage_memory: Sequence[float] | None = None,
             transient: Callable[[Op], float] | None = None, overlap_host: Cost = 0.0,
             tbw: Cost | None = None, all_to_all_count: tuple | None = None) -> SimResult:
    if check:
        validate(schedule)
    comm = _comm_fn(schedule, all_to_all, seq_costs)
    compute = _duration_fn(schedule, tf, tb, tw, seq_costs, op_overhead, {"head": head, "embed": embed}, tbw)
    duration = compute if all_to_all is None else lambda op: compute(op) + comm(op)  # synchronous: the op waits
    index = UnitIndex(schedule)
    host = _per_stage(overlap_host, schedule, "overlap_host")
    count = None if all_to_all_count is None else _comm_fn(schedule, all_to_all_count, None, shared=False)
    units = [schedule.units(r) for r in range(schedule.pp)]
    hidden = [0.0] * schedule.pp
    hosted = [0.0] * schedule.pp

    def unit_time(r: int, unit: tuple) -> float:
        if len(unit) == 1:
            return duration(unit[0])
        (a, b), (ca, cb), (xa, xb) = unit, (compute(op) for op in unit), (comm(op) for op in unit)
        ha, hb = host[a.stage], host[b.stage]
        hosted[r] += ha + hb
        if count is None:
            span = ca + cb + max(0.0, xa - cb) + max(0.0, xb - ca) + ha + hb
        else:
            span = piecewise([(ca + ha, xa, round(count(a))), (cb + hb, xb, round(count(b)))])
        hidden[r] += ca + cb + xa + xb + ha + hb - span
        return span

    start: dict[Op, float] = {}
    end: dict[Op, float] = {}
    sent = [0] * schedule.pp
    pos = [0] * schedule.pp
    clock = [0.0] * schedule.pp
    remaining = sum(len(u) for u in units)
    # Start times depend only on dependencies and the previous unit of the same rank, so any
    # order of visiting the ranks gives the same result. An overlapped unit starts when both its
    # ops' inputs are there, and both end when it ends (each side's last piece ends near the end).
    while remaining:
        progressed = False
        for r in range(schedule.pp):
            while pos[r] < len(units[r]):
                unit = units[r][pos[r]]
                deps = [(d, op) for op in unit for d in index.deps(op)]
                if any(d not in end for d, _ in deps):
                    break
                t = clock[r]
                for d, op in deps:
                    if index.is_message(d, op):
                        t = max(t, end[d] + p2p_latency)
                        sent[index.where[d][0]] += 1
                    else:
                        t = max(t, end[d])
                stop = clock[r] = t + unit_time(r, unit)
                for op in unit:
                    start[op], end[op] = t, stop
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ScheduleError("simulation stalled: the op lists deadlock (run validate for details)")
    result = _summarize(schedule, start, end, sent, _memory_fn(schedule, act_size, head_memory, stage_memory),
                        transient)
    result.all_to_all = [sum(comm(op) for op in ops) for ops in schedule.ranks]
    result.all_to_all_hidden, result.overlap_host = hidden, hosted
    return result


def _per_stage(value: Cost, schedule: Schedule, what: str) -> list[float]:
    if isinstance(value, (int, float)):
        return [float(value) * schedule.pp / schedule.stages] * schedule.stages
    vals = [float(v) for v in value]
    if len(vals) != schedule.stages:
        raise ScheduleError(f"{what} lists {len(vals)} costs for a schedule with "
                            f"{schedule.stages} stages per replica (give one number or one per stage)")
    return vals


def _seq_shares(schedule: Schedule, seq_costs: Sequence[float] | None) -> list[float]:
    k = schedule.seq_splits
    if seq_costs is None:
        return [1.0 / k] * k
    if len(seq_costs) != k or any(c <= 0 for c in seq_costs):
        raise ScheduleError(f"seq_costs must be {k} positive numbers (seq_costs={list(seq_costs)})")
    total = float(sum(seq_costs))
    return [c / total for c in seq_costs]


def _duration_fn(schedule, tf, tb, tw, seq_costs, op_overhead, vocab: dict, tbw=None) -> Callable[[Op], float]:
    f = _per_stage(tf, schedule, "tf")
    b = _per_stage(tb, schedule, "tb")
    w = _per_stage(tw, schedule, "tw")
    share = _seq_shares(schedule, seq_costs)
    base = {kind: [cf * x + cb * y + cw * z for x, y, z in zip(f, b, w)]
            for kind in Kind for cf, cb, cw in [kind.traits.cost]}
    if tbw is not None:
        base[Kind.BW] = _per_stage(tbw, schedule, "tbw")
    for kind in Kind:  # a vocabulary slice: 1/p of its layer, on every rank alike
        if kind.traits.vocab:
            layer = vocab[kind.traits.vocab]
            base[kind] = [sum(c * x for c, x in zip(kind.traits.cost, layer)) / schedule.pp] * schedule.pp
    fixed = {kind: sum(c * o for c, o in zip(kind.traits.cost, op_overhead)) for kind in Kind}
    return lambda op: base[op.kind][op.stage] * share[op.seq] + fixed[op.kind]


def piecewise(sides: list) -> float:
    """The span of an overlapped unit run as pipe/moe/overlap.py runs it: each side (compute c, all-to-all x, count k)
    is k + 1 equal compute pieces with an all-to-all of x / k after each but the last; the first side starts, and
    a side that issues an all-to-all hands over to the other (while that one still runs), which first waits on
    its own in-flight all-to-all, then computes its next piece. Both sides' all-to-alls can be in flight at once."""
    steps = [[(c / (k + 1), x / k if i < k else None) for i in range(k + 1)] if k else [(c + x, None)]
             for c, x, k in sides]
    t, due, at, side = 0.0, [0.0, 0.0], [0, 0], 0
    while at[0] < len(steps[0]) or at[1] < len(steps[1]):
        piece, latency = steps[side][at[side]]
        t = max(t, due[side]) + piece
        at[side] += 1
        if latency is not None:
            due[side] = t + latency
        if at[1 - side] < len(steps[1 - side]):  # hands over; with the other side done it goes on alone
            side = 1 - side
    return t


def _comm_fn(schedule: Schedule, all_to_all: tuple | None, seq_costs, shared: bool = True) -> Callable[[Op], float]:
    """The all-to-all time inside one op: F pays the stage's forward one, B and BW its backward one
    (a segment its share, as of the compute, when `shared`), W and the vocabulary passes none."""
    if all_to_all is None:
        return lambda op: 0.0
    f, b = (_per_stage(t, schedule, "all_to_all") for t in all_to_all)
    share = _seq_shares(schedule, seq_costs) if shared else [1.0] * schedule.seq_splits
    per = {kind: [0.0] * schedule.stages if kind.traits.vocab else
           [kind.traits.cost[0] * x + kind.traits.cost[1] * y for x, y in zip(f, b)] for kind in Kind}
    return lambda op: per[op.kind][op.stage] * share[op.seq]


def _memory_fn(schedule: Schedule, act_size: ActSize, head_memory: float,
               stage_memory: Sequence[float] | None = None) -> Callable[[Op], float]:
    """Memory change of one op (positive: allocates)."""
    logits = _logits_fn(schedule, head_memory)
    if callable(act_size):
        sizes = act_size
    else:
        if act_size is None:
            m_b, m_w = DEFAULT_ACT
        elif isinstance(act_size, (int, float)):
            m_b, m_w = float(act_size), float(act_size) * DEFAULT_ACT[1] / DEFAULT_ACT[0]
        else:
            m_b, m_w = (float(x) for x in act_size)
        scale = schedule.pp / schedule.stages
        stage = [1.0] * schedule.stages if stage_memory is None else [float(x) for x in stage_memory]
        if len(stage) != schedule.stages:
            raise ScheduleError(f"stage_memory lists {len(stage)} stages for a schedule with {schedule.stages}")
        share = _token_shares(schedule)
        sizes = lambda op: (m_b * scale * stage[op.stage] * share[op.seq],  # noqa: E731
                            m_w * scale * stage[op.stage] * share[op.seq])
    def delta(op: Op) -> float:
        if op.kind.traits.vocab:
            return logits(op)
        m_b, m_w = sizes(op)
        per_b, per_w = op.kind.traits.memory
        return per_b * m_b + per_w * m_w + logits(op)
    return delta


def _logits_fn(schedule: Schedule, head_memory: float) -> Callable[[Op], float]:
    """What an op adds to (or frees from) the memory the logits hold."""
    share = _token_shares(schedule)
    if schedule.vocab_parallel:
        per_slice = head_memory / schedule.pp
        return lambda op: op.kind.traits.memory[0] * per_slice * share[op.seq] if op.kind.traits.vocab else 0.0
    last = schedule.loss_stage

    def naive(op: Op) -> float:
        if op.stage != last or not head_memory:
            return 0.0
        if op.kind is Kind.F:
            return head_memory * share[op.seq]
        if op.kind in (Kind.W, Kind.BW):  # a split backward keeps the logits' gradient for W
            return -head_memory * share[op.seq]
        return 0.0
    return naive


def _token_shares(schedule: Schedule) -> list[float]:
    """Each sequence segment's share of a micro-batch's activations: its tokens' share when the
    schedule knows its segment lengths (they hold activations per token), else 1/k."""
    lengths = schedule.segment_lengths
    if lengths is None or len(lengths) != schedule.seq_splits:
        return [1.0 / schedule.seq_splits] * schedule.seq_splits
    return [n / sum(lengths) for n in lengths]


def _summarize(schedule, start, end, sent, delta, transient=None) -> SimResult:
    t0 = min(start.values())
    makespan = max(end.values()) - t0
    busy, bubble, own, peak = [], [], [], []
    for r, lst in enumerate(schedule.ranks):
        units = schedule.units(r)
        work = sum(end[u[0]] - start[u[0]] for u in units)   # an overlapped unit's span counts once
        busy.append(work)
        bubble.append((makespan - work) / makespan if makespan > 0 else 0.0)
        span = (end[lst[-1]] - start[lst[0]]) if lst else 0.0
        own.append((span - work) / span if span > 0 else 0.0)
        level = top = 0.0
        for unit in units:
            if transient is not None:
                top = max(top, level + max(transient(op) for op in unit))
            # inside an overlapped unit the forward's pieces allocate while the backward's free: count the
            # allocations first (the unit's peak can reach them both)
            for d in sorted(delta(op) for op in unit)[::-1]:
                level += d
                top = max(top, level)
        peak.append(top)
    return SimResult(schedule=schedule, start=start, end=end, makespan=makespan, busy=busy,
                     bubble=bubble, bubble_ratio=max(bubble), own_bubble=own, peak_memory=peak,
                     p2p_messages=sum(sent), p2p_sent=sent)
