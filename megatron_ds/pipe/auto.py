"""The engine side of `"schedule": "auto"`: time the ops, decide on rank 0, broadcast, switch.

The run starts on the schedule pipe/plan.start_auto picked (one that splits B and W and fits the
budget). During this process's training iterations [timers_start_iter, timers_end_iter) the
engine's tracer hands every recorded iteration here (no files are written unless trace_dir is
set): each compute op's time, from when its input had arrived to its end. After the window every
rank sends its median F, B and W time per stage to rank 0, adjacent ranks time a ping-pong of one
activation message (the p2p time), and rank 0 simulates every candidate that fits the budget
(schedules/auto.py), logs the choice and the runner-up, and broadcasts the choice (one small
object). A choice that places the chunks as the module is cut is a schedule swap, done here; any
other needs the module rebuilt, which the owner of the engine does (training/auto_switch.py) when
`engine.pending_switch` is set.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from megatron_ds.schedules import auto
from megatron_ds.schedules.kinds import Kind
from megatron_ds.schedules.timeline import COMPUTE

PING_REPEATS = 5


class AutoSwitch:
    """Owned by a ScheduleEngine whose plan has an AutoPlan; see the module docstring."""

    choose = staticmethod(auto.decide)  # rank 0's decision: decide(pp, m, num_layers, budget, Measured)

    def __init__(self, engine, auto_plan):
        self.engine, self.auto_plan = engine, auto_plan
        self.calls = 0  # training iterations this process has run
        self.times = {}  # (kind name, stage) -> [seconds]

    def train_batch(self, run):
        """`run()` (the engine's train_batch), timed inside the window; after its last iteration,
        decide and swap the schedule, or leave the choice in `engine.pending_switch`."""
        start, end = self.auto_plan.timers
        eng = self.engine
        eng.tracer.listener = self.record if start <= self.calls < end else None
        try:
            loss = run()
        finally:
            eng.tracer.listener = None
        self.calls += 1
        if self.calls == end:
            decision = self.decide()
            eng.auto, eng.auto_decision = None, decision  # the trainer logs it and takes it back
            choice = decision["choice"]
            if eng.plan.places_alike(choice["section"]):
                eng.plan.switch(choice["section"], auto.schedule_maker(choice))
            else:
                eng.pending_switch = decision
        return loss

    def record(self, trace):
        for _, tid, start, end, args in trace.events:
            if tid == COMPUTE and args["kind"] in (Kind.F, Kind.B, Kind.W):
                self.times.setdefault((args["kind"].name, args["stage"]), []).append(end - start)

    def decide(self) -> dict:
        eng = self.engine
        medians = {key: statistics.median(v) for key, v in self.times.items()}
        ping = ping_pong(eng, eng.plan.activation_shape, eng._dtype, eng.device)
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object((medians, ping), gathered, dst=0)
        box = [None]
        if dist.get_rank() == 0:
            measured = merge(gathered, eng.plan.schedule.stages)
            box[0] = self.choose(eng.num_stages, eng.plan.micro_batches, self.auto_plan.num_layers,
                                 self.auto_plan.budget, measured)
            box[0]["start"] = eng.plan.schedule.name
            print(auto.describe(box[0]), flush=True)
        dist.broadcast_object_list(box, src=0)
        return box[0]


def merge(gathered, stages: int) -> auto.Measured:
    """Per stage, the median over the ranks that ran it (data-parallel replicas) of their medians."""
    per = {}
    pings = []
    for medians, ping in gathered:
        pings += ping
        for key, t in medians.items():
            per.setdefault(key, []).append(t)
    missing = [(k, s) for k in "FBW" for s in range(stages) if (k, s) not in per]
    if missing:
        raise RuntimeError(f'"schedule": "auto" timed no op of {missing}: time at least one training iteration')
    f, b, w = ([statistics.median(per[(k, s)]) for s in range(stages)] for k in "FBW")
    return auto.Measured(f, b, w, statistics.median(pings) if pings else 0.0)


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


def chosen_ds_config(ds_config: dict, decision: dict) -> dict:
    """The ds_config that builds the chosen schedule (the "auto" keys dropped)."""
    from .config import AUTO_KEYS
    section = {k: v for k, v in (ds_config.get("pipeline") or {}).items() if k not in AUTO_KEYS}
    section.update(decision["choice"]["section"])
    return {**ds_config, "pipeline": section}
