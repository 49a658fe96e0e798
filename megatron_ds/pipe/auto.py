"""The engine side of `"schedule": "auto"`: time the ops, decide on rank 0, broadcast, switch.

The run starts on the schedule pipe/plan/auto_start.start_auto picked (one that splits B and W and fits the
budget). During this process's training iterations [timers_start_iter, timers_end_iter) the
engine's tracer hands every recorded iteration here (no files are written unless trace_dir is
set): each compute op's time, from when its input had arrived to its end, and the runtime's time
between ops. Every second iteration of the window runs the plan's probe instead, when it has one:
the same placement with the micro-batch cut into another number of Seq1F1B segments, so that
rank 0 can tell each op's fixed time from its per-token time (schedules/measurement.separate). After the
window every rank sends its medians per (kind, stage, op size, segment) to rank 0, adjacent ranks
time a ping-pong of one activation message (the p2p time), and rank 0 simulates every candidate
that fits the budget (schedules/auto.py), logs the choice and the runner-up, and broadcasts the
choice (one small object). Under vocabulary parallelism the vocabulary passes (EF, S, T, EW) are
timed too, per slice, and give the embedding's and the head's costs. A mixture of experts: the
expert-parallel all-to-all that ran inside an F or B op (model/moe_dispatch.AllToAllTimes times every one)
is taken out of the op's time and kept apart, and rank 0 learns which layers of each stage have experts, so
that a MoE layer's cost is told from a dense one's and the all-to-all stated on its own
(schedules/measurement.moe_costs). Where the all-to-all runs (expert parallelism > 1), rank 0 weighs the
overlapped orders too (schedules/auto.decide's `overlap`), their pieces paying the host time
`piece_host` measured on each expert-parallel rank after the window (the runtime's switching between a unit's
sides, timed alone); a MoE model without it is weighed as well, so that the log line says why not (no all-to-all
to hide). A choice that
places the chunks as the module is cut is a schedule swap, done here; any other needs the module rebuilt, which the owner of the engine does
(training/auto_schedule.py). Either way the engine reports the decision once, through its
`on_auto_decision` hook (an AutoDecision). Under "auto_recompute" the recompute setting is chosen too
(schedules/auto_recompute.py); another setting than the one the run was timed under is a rebuild.
"""
from __future__ import annotations

import bisect
import dataclasses
import socket
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_ds.model.layers import TransformerLayer
from megatron_ds.model.moe import MoE
from megatron_ds.model.moe_dispatch import AllToAllTimes, InFlight
from megatron_ds.schedules import auto, auto_recompute
from megatron_ds.schedules import measurement
from megatron_ds.schedules.costs import A2A_PER_MOE_LAYER, PIECES_MOE
from megatron_ds.schedules import Op
from megatron_ds.schedules.kinds import VOCAB, Kind
from megatron_ds.schedules.timeline import COMPUTE, P2P

from .deepspeed import ds_internals as ds
from .plan.config import AUTO_KEYS
from .plan.partition import layer_flops

PING_REPEATS = 5
PIECE_REPEATS = 21  # piece_host's samples (a median: a loaded CPU's outliers)
TIMED = frozenset({Kind.F, Kind.B, Kind.W} | VOCAB)  # the op kinds whose times the decision takes
VOCAB_NAMES = frozenset(k.name for k in VOCAB)


@dataclass(frozen=True)
class AutoDecision:
    """What "auto" decided, handed once to the engine's `on_auto_decision` hook. `decision`:
    schedules/auto.decide's (JSON-able; a checkpoint's auto_schedule.json holds it), plus "start", the
    schedule the run timed on. `rebuild`: the choice places the chunks otherwise than the module is
    cut, so the owner must rebuild the engine (training/auto_schedule.switch_engine); else the engine
    already runs it."""
    decision: dict
    rebuild: bool


class AutoSwitch:
    """Owned by the ScheduleEngine of an "auto" run, with its AutoPlan (pipe/plan/plan.py); see the module docstring."""

    choose = staticmethod(auto.decide)  # rank 0's decision: decide(pp, m, num_layers, budget, Measured, cuts)

    def __init__(self, engine, auto_plan):
        self.engine, self.auto_plan = engine, auto_plan
        self.calls = 0  # training iterations this process has run
        self.times = {}  # (kind name, stage, seq_splits, seq) -> [seconds]
        self.comm = {}  # the same keys (F and B of MoE stages) -> [seconds of all-to-all inside the op, not in times]
        self.gaps = []  # the runtime's seconds between two compute ops, per op, one entry per iteration
        self.ops = []  # per timed iteration: {Op: (start, end, start of the receive wait it ended, or None)}
        self.schedules = []  # the schedule each timed iteration ran
        self.start_section = {"schedule": engine.plan.settings.schedule, "seq_splits": engine.plan.settings.seq_splits,
                              "split_backward": engine.plan.settings.split_backward}

    def train_batch(self, run):
        """`run()` (the engine's train_batch), timed inside the window (every second iteration on the
        probe); after its last iteration, decide, swap the schedule when the module allows, and report
        the decision through `engine.on_auto_decision`."""
        start, end = self.auto_plan.timers
        eng = self.engine
        timed = start <= self.calls < end
        probing = timed and self.auto_plan.probe is not None and (self.calls - start) % 2 == 1
        eng.tracer.listener = self.record if timed else None
        AllToAllTimes.intervals = [] if timed else None
        if probing:
            eng.use_plan(eng.plan.switch(self.auto_plan.probe, cuts=self.auto_plan.cuts))
        try:
            loss = run()
        finally:
            eng.tracer.listener = None
            AllToAllTimes.intervals = None
            if probing:
                eng.use_plan(eng.plan.switch(self.start_section, cuts=self.auto_plan.cuts))
        self.calls += 1
        if self.calls == end:
            decision = self.decide()
            eng.auto = None
            choice = decision["choice"]
            alike = (eng.plan.places_alike(choice["section"])  # and the layers recompute as they do (auto_recompute)
                     and choice.get("recompute", self.auto_plan.recompute) == self.auto_plan.recompute)
            if alike:
                eng.use_plan(eng.plan.switch(choice["section"], auto.schedule_maker(choice), self.auto_plan.cuts))
            if eng.on_auto_decision is not None:
                eng.on_auto_decision(AutoDecision(decision, rebuild=not alike))
        return loss

    def record(self, trace):
        k = self.engine.plan.schedule.seq_splits
        compute = [(start, end, args) for _, tid, start, end, args in trace.events if tid == COMPUTE]
        comm = sorted(AllToAllTimes.intervals or [])
        AllToAllTimes.intervals = [] if AllToAllTimes.intervals is not None else None
        for start, end, args in compute:
            if args["kind"] in TIMED:
                key = (args["kind"].name, args["stage"], k, args["seq"])
                waited = inside(comm, start, end) if args["kind"] in (Kind.F, Kind.B) else 0.0
                self.times.setdefault(key, []).append(end - start - waited)  # the compute: what `separate` cuts
                if waited:
                    self.comm.setdefault(key, []).append(waited)
        waits = {end: start for name, tid, start, end, _ in trace.events if tid == P2P and name.startswith("recv")}
        self.ops.append({Op(a["kind"], a["replica"], a["stage"], a["mb"], a["seq"]): (start, end, waits.get(start))
                         for start, end, a in compute})
        self.schedules.append(self.engine.plan.schedule)
        if compute:
            first, last = min(c[0] for c in compute), max(c[1] for c in compute)
            waits = sum(min(e, last) - max(s, first) for _, tid, s, e, _ in trace.events  # p2p and step events
                        if tid != COMPUTE and e > first and s < last)
            self.gaps.append(max(0.0, last - first - sum(e - s for s, e, _ in compute) - waits) / len(compute))

    def decide(self) -> dict:
        eng = self.engine
        medians = {key: statistics.median(v) for key, v in self.times.items()}
        comm = {key: statistics.median(v) for key, v in self.comm.items()}
        gap = statistics.median(self.gaps) if self.gaps else 0.0
        traced = (socket.gethostname(), eng.grid.get_data_parallel_rank(), self.ops)
        moe = [m for m in eng.module.modules() if isinstance(m, MoE)]
        experts = {m.layer_idx for m in moe}
        host = piece_host(eng._overlap()) if moe and moe[0].ep_group else None
        ping = ping_pong(eng, eng.plan.activation_shape, eng._dtype, eng.device)
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object((medians, ping, gap, traced, comm, experts, host), gathered, dst=0)
        box = [None]
        if dist.get_rank() == 0:
            vocab_parallel = eng.plan.settings.vocab_parallel
            measured = merge([g[:4] for g in gathered], eng.plan.schedule.stages, self.schedules)
            moe_layers = set().union(*(g[5] for g in gathered))
            measured = with_experts(measured, eng.module, moe_layers, [g[4] for g in gathered])
            hosts = [g[6] for g in gathered if g[6] is not None]
            measured = dataclasses.replace(measured, piece_host=statistics.median(hosts) if hosts else 0.0)
            if not vocab_parallel:  # else the head is no part of the loss stage
                measured = dataclasses.replace(measured, head_share=measurement.head_share(
                    self.auto_plan.head_layers, self.auto_plan.num_layers, eng.plan.schedule.stages))
            runs = traced_runs([g[3] for g in gathered], self.schedules)
            measured = measurement.calibrate(measured, eng.num_stages, runs, self.auto_plan.cuts)
            knobs = self.auto_plan.knobs  # "auto_recompute": counted for this device's attention kernels
            knobs = {"knobs": knobs.on_device(torch.device(eng.device).type == "cuda"),
                     "running": auto_recompute.of_dict(self.auto_plan.recompute)} if knobs else {}
            if moe_layers and not vocab_parallel:  # weighed, or told why not (no all-to-all)
                knobs["overlap"] = True
            box[0] = self.choose(eng.num_stages, eng.plan.micro_batches, self.auto_plan.num_layers,
                                 self.auto_plan.budget, measured, self.auto_plan.cuts, vocab_parallel=vocab_parallel,
                                 head_memory=self.auto_plan.head_memory, **knobs)
            box[0]["start"] = eng.plan.schedule.name
            print(auto.describe(box[0]), flush=True)
        dist.broadcast_object_list(box, src=0)
        return box[0]


def inside(intervals: list, start: float, end: float) -> float:
    """Seconds of the sorted (start, end) `intervals` that fall within [start, end]."""
    lo = bisect.bisect_left(intervals, (start,))
    hi = bisect.bisect_right(intervals, (end, float("inf")))
    return sum(max(0.0, min(e, end) - max(s, start)) for s, e in intervals[max(0, lo - 1):hi])


def layer_kinds(module, experts: set) -> tuple:
    """Per virtual stage of `module` (its `parts`), a 0/1 per transformer layer it holds: 1 when that layer
    (its global index, MoE.layer_idx) is among `experts`. Every rank holds every layer's spec."""
    specs = ds.layer_specs(module)
    flags = [None if spec.typename is not TransformerLayer else int(spec.module_args[1] in experts) for spec in specs]
    return tuple(tuple(f for f in flags[a:b] if f is not None) for a, b in zip(module.parts, module.parts[1:]))


def moe_flops(module, kinds: tuple) -> float:
    """A MoE layer's forward FLOPs over a dense layer's, from the model's sizes (1 when either is missing)."""
    specs = [spec for spec in ds.layer_specs(module) if spec.typename is TransformerLayer]
    if not specs:
        return 1.0
    flops = layer_flops(specs[0].module_args[0])[1:-2]  # the transformer layers'
    flat = [f for k in kinds for f in k]
    moe = [x for x, f in zip(flops, flat) if f]
    dense = [x for x, f in zip(flops, flat) if not f]
    return statistics.mean(moe) / statistics.mean(dense) if moe and dense else 1.0


def with_experts(measured: measurement.Measured, module, experts: set, comm: list) -> measurement.Measured:
    """`measured` with the MoE layers of each stage and the all-to-all time inside each stage's F and B, which
    its op times do not hold (per (kind, stage, op size, segment) the median over the ranks of their medians,
    a micro-batch's the sum over its segments, at the op size `separate` kept: the simulator charges a segment
    its share of it); unchanged for a dense model."""
    if not experts:
        return measured
    kinds = layer_kinds(module, experts)
    per = {}
    for medians in comm:
        for key, t in medians.items():
            per.setdefault(key, []).append(t)
    k = min(measured.op_sizes)
    stage = [[0.0, 0.0] for _ in kinds]
    for (kind, s, size, _), ts in per.items():
        if size == k:
            stage[s]["FB".index(kind)] += statistics.median(ts)
    return dataclasses.replace(measured, layer_kinds=kinds, moe_flops=moe_flops(module, kinds),
                               all_to_all=tuple(tuple(x) for x in stage))


def merge(gathered, stages: int, schedules: list) -> measurement.Measured:
    """Per (kind, stage, op size, segment), the median over the ranks that ran it (data-parallel
    replicas) of their medians; a micro-batch's time per op size is the sum over its segments. The
    p2p time: the median message latency the traces show (`schedules[i]` ran timed iteration i),
    when every rank is on one host (one clock), else the ping-pong's."""
    per, pings, gaps = {}, [], []
    for medians, ping, gap, _ in gathered:
        pings += ping
        gaps.append(gap)
        for key, t in medians.items():
            per.setdefault(key, []).append(t)
    latencies = traced_latencies([t for *_, t in gathered], schedules)
    totals = {}
    for kind, stage, k, seq in per:
        totals.setdefault(k, {}).setdefault((kind, stage), {})[seq] = statistics.median(per[(kind, stage, k, seq)])
    for k, by_op in totals.items():
        missing = [(kind, s) for kind in "FBW" for s in range(stages) if len(by_op.get((kind, s), ())) != k]
        if missing:
            raise RuntimeError(f'"schedule": "auto" timed no op of {missing} (seq_splits={k}): time at least one '
                               "training iteration")
    sums = {k: tuple([sum(by_op[(kind, s)].values()) for s in range(stages)] for kind in "FBW")
            for k, by_op in totals.items()}
    p2p = statistics.median(latencies) if latencies else statistics.median(pings) if pings else 0.0
    measured = measurement.separate(sums, statistics.median(gaps), p2p)
    k = min(totals)  # the op size `separate` keeps the times of
    slices = {}  # vocabulary pass -> each slice's time on a micro-batch (its stage is the slice)
    for (kind, _), by_seq in totals[k].items():
        if kind in VOCAB_NAMES:
            slices.setdefault(kind, []).append(sum(by_seq.values()))
    if not slices:
        return measured
    return measurement.with_vocab(measured, {kind: statistics.median(t) for kind, t in slices.items()}, k)


def replica_iterations(traced: list, schedules: list):
    """(schedule, {Op: (start, end, wait start)}) of every timed iteration of every pipeline
    replica, put together from its ranks' records; nothing when the ranks span hosts (clocks)."""
    if len({host for host, _, _ in traced}) != 1:
        return
    for i, schedule in enumerate(schedules):
        for dp in sorted({dp for _, dp, _ in traced}):
            timed = {}
            for _, d, ops in traced:
                if d == dp:
                    timed.update(ops[i])
            yield schedule, timed


def traced_latencies(traced: list, schedules: list) -> list:
    """Message latencies of every timed iteration of every pipeline replica."""
    return [t for schedule, timed in replica_iterations(traced, schedules)
            for t in measurement.message_latencies(schedule, timed)]


def traced_runs(traced: list, schedules: list) -> list:
    """(schedule, makespan: first op's start to last op's end) of each timed iteration and replica."""
    return [(schedule, max(e for _, e, _ in timed.values()) - min(s for s, _, _ in timed.values()))
            for schedule, timed in replica_iterations(traced, schedules) if timed]


def piece_host(runner, repeats: int = PIECE_REPEATS) -> float:
    """Seconds of host time one piece of an overlapped unit adds (ModelCosts.piece_host), on this rank: the
    runtime's own switching timed with nothing else in it. The window runs a plain start-up schedule, no unit, so a
    unit cannot be timed against its two ops; instead `runner` (the engine's pipe/moe/overlap.OverlapRunner) runs a
    unit whose sides do no work but hand the baton over where a MoE layer's all-to-alls are issued (3 in the
    forward: counts, rows, combine; 2 in the backward), each hand-over swapping the sides' process-wide state and
    waking the other thread, as a real unit does; the median of `repeats` such units, over the pieces a MoE
    layer's unit runs in the simulator (2 x PIECES_MOE), is the time per piece."""
    def side(hand_overs):
        def run():
            for _ in range(hand_overs):
                InFlight.meanwhile()
        return run
    forward, backward, times = side(A2A_PER_MOE_LAYER[0]), side(A2A_PER_MOE_LAYER[1]), []
    for _ in range(repeats):
        start = time.perf_counter()
        runner.run(forward, backward, backward_first=False)
        times.append(time.perf_counter() - start)
    return statistics.median(times) / (2 * PIECES_MOE)


def ping_pong(engine, shape, dtype, device, repeats: int = PING_REPEATS) -> list:
    """One-way times of an activation message between pipeline neighbours (r, r+1), even pairs
    first, then odd ones: every rank is in at most one pair at a time. The leader keeps them."""
    r, p = engine.stage_id, engine.num_stages
    buf = torch.zeros(shape, dtype=dtype, device=device)
    times = []
    for parity in (0, 1):
        if r % 2 == parity and r + 1 < p:
            peer = engine.grid.stage_to_global(stage_id=r + 1)
            for _ in range(repeats):
                start = time.perf_counter()
                dist.send(buf, peer)
                dist.recv(buf, peer)
                times.append((time.perf_counter() - start) / 2)
        elif r >= 1 and (r - 1) % 2 == parity:
            peer = engine.grid.stage_to_global(stage_id=r - 1)
            for _ in range(repeats):
                dist.recv(buf, peer)
                dist.send(buf, peer)
    return times


def candidate_labels(pp: int, m: int, num_layers: int, cuts: tuple, vocab_parallel: bool, moe) -> list:
    """The labels of the catalogued candidates "auto" weighs for this run (a resumed decision is reused only
    under the same ones): with expert parallelism (MoEConfig `moe`) the overlapped orders too."""
    pool = [(c, s, None) for c, s in auto.candidates(pp, m, num_layers, cuts, vocab_parallel=vocab_parallel)]
    if moe is not None and moe.expert_model_parallel_size > 1 and not vocab_parallel:
        pool += auto.overlapped(pp, m, num_layers, pool)
    return sorted(c.label for c, _, _ in pool)


def chosen_ds_config(ds_config: dict, decision: dict) -> dict:
    """The ds_config that builds the chosen schedule (the "auto" keys dropped)."""
    section = {k: v for k, v in (ds_config.get("pipeline") or {}).items() if k not in AUTO_KEYS}
    section.update(decision["choice"]["section"])
    return {**ds_config, "pipeline": section}
