"""Op traces: when each compute and communication instruction of an iteration really ran.

`"pipeline": {"trace_dir": PATH}` in the ds_config makes every rank record, for each
training iteration, the start and end of every instruction its engine executes: compute
ops (F, B, W, BW with replica, stage, micro-batch and segment), point-to-point waits
(receive waits inside compute ops, send completion, DeepSpeed's blocking sends/receives and
batched commits), micro-batch loading, gradient reductions and the optimizer step. Each rank
writes one Chrome/Perfetto trace (JSON object format, "ph": "X" events, pid = global rank,
times in microseconds) per iteration to PATH/step{N:06d}_rank{R:05d}.json, atomically
(written aside, then renamed). Open it in ui.perfetto.dev or chrome://tracing, or merge the
ranks and draw them with tools/trace_to_png.py.

Times are time.perf_counter() relative to an origin taken right after a barrier at the start
of the iteration, so the files of all ranks line up. The absolute origin and the host name
are kept as well: when every file comes from one host, `load_iteration` aligns the ranks on
the shared monotonic clock instead (exact, no barrier skew).

A compute op's event starts when its input has arrived: a receive the op waits on is its own
"p2p" event, so compute events show the work and p2p events the waiting. Events sit on three
threads per rank: 0 compute, 1 p2p, 2 step (loading, reductions, optimizer).

Engines get it from TraceMixin, placed before PipelineEngine in the bases (ScheduleEngine
does; `traced_engine(cls)` makes such a class for DeepSpeed's own PipelineEngine and
DualPipeVEngine). Without a trace_dir, `_exec_schedule` is DeepSpeed's untouched.
"""
from __future__ import annotations

import glob
import json
import os
import re
import socket
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_ds.schedules import Op, Schedule
from megatron_ds.schedules.kinds import Kind

from .instructions import INSTRUCTION_TO_KIND

FORMAT = "megatron_ds-trace-1"
COMPUTE, P2P, STEP = 0, 1, 2
THREADS = {COMPUTE: "compute", P2P: "p2p", STEP: "step"}
# Instruction class name -> op kind, for our instructions and DeepSpeed's.
COMPUTE_KINDS = {**INSTRUCTION_TO_KIND, "ForwardPass": Kind.F, "BackwardPass": Kind.BW}
P2P_INSTRUCTIONS = {"SendActivation", "RecvActivation", "SendGrad", "RecvGrad", "CommitP2P", "FinishP2P"}
FILE_RE = re.compile(r"step(\d+)_rank(\d+)\.json$")


def trace_path(trace_dir: str, step: int, rank: int) -> str:
    return os.path.join(trace_dir, f"step{step:06d}_rank{rank:05d}.json")


# -- recording -----------------------------------------------------------------------------------

class IterationTrace:
    """One rank's events of one iteration (times in seconds from the origin)."""

    def __init__(self, engine):
        self.engine = engine
        self.events = []  # (name, tid, start, end, args)
        self.resume = None  # end of the last receive wait inside the current instruction
        self.counters = {}  # (kind, phase) -> ops seen, DeepSpeed's engines only
        if dist.is_initialized():
            dist.barrier()
        self.origin = time.perf_counter()
        self.origin_unix = time.time()

    def wrap(self, instruction_map):
        return {cls: self._timed(fn, cls.__name__) for cls, fn in instruction_map.items()}

    def _timed(self, fn, name):
        clock = time.perf_counter

        def run(engine, **kwargs):
            self.resume = None
            start = clock()
            fn(engine, **kwargs)
            end = clock()
            self.instruction(name, kwargs, start, end)
        return run

    def instruction(self, name, kwargs, start, end):
        kind = COMPUTE_KINDS.get(name)
        if kind is not None:
            if self.resume is not None:
                start = max(start, self.resume)
            label, args = self._op(kind, kwargs)
            self.events.append((label, COMPUTE, start, end, args))
        else:
            self.events.append((name, P2P if name in P2P_INSTRUCTIONS else STEP, start, end, dict(kwargs)))

    def wait(self, key, start, end):
        self.resume = end
        what = f"recv {key[0]}" if isinstance(key, tuple) else "recv"
        self.events.append((what, P2P, start, end, {"key": list(key) if isinstance(key, tuple) else str(key)}))

    def _op(self, kind, kwargs):
        eng = self.engine
        sched = getattr(eng, "sched", None)
        if "stage" in kwargs:  # our instructions name their op
            op = Op(kind, kwargs["replica"], kwargs["stage"], kwargs["mb"], kwargs.get("seq", 0))
            label = sched.op_label(eng.stage_id, op) if sched is not None else f"{kind}{op.mb}"
        else:  # DeepSpeed's: micro-batches run in order per (kind, phase); phase 1 is the V's second leg
            phase = kwargs.get("phase", 0) or 0
            n = self.counters.get((kind, phase), 0)
            self.counters[(kind, phase)] = n + 1
            stage = eng.stage_id if phase == 0 else 2 * eng.num_stages - 1 - eng.stage_id
            op = Op(kind, 0, stage, n, 0)
            label = f"{kind}{n}" + "'" * phase
        return label, {"kind": op.kind, "replica": op.replica, "stage": op.stage, "mb": op.mb, "seq": op.seq}

    def meta(self, step):
        eng = self.engine
        sched = getattr(eng, "sched", None)
        pp = eng.num_stages
        if sched is not None and hasattr(sched, "placement"):
            schedule, stages, placement = sched.name, sched.stages, sched.placement
            replicas, seq_splits = sched.replicas, sched.seq_splits
        elif hasattr(eng.module, "phase_bounds"):  # DeepSpeed's DualPipeV: a V over 2p stages
            schedule, stages, replicas, seq_splits = "dualpipev", 2 * pp, 1, 1
            placement = [list(range(pp)) + list(reversed(range(pp)))]
        else:
            schedule, stages, replicas, seq_splits = "deepspeed", pp, 1, 1
            placement = [list(range(pp))]
        settings = getattr(eng, "settings", None)
        return {"format": FORMAT, "rank": dist.get_rank() if dist.is_initialized() else 0,
                "stage_id": eng.stage_id, "pp": pp, "dp": eng.dp_world_size, "step": step,
                "engine": type(eng).__name__, "schedule": schedule, "micro_batches": eng.micro_batches,
                "stages": stages, "replicas": replicas, "seq_splits": seq_splits, "placement": placement,
                "virtual_stages": getattr(settings, "virtual_stages", 1),
                "split_backward": getattr(settings, "split_backward", False),
                "host": socket.gethostname(), "origin_perf_counter": self.origin, "origin_unix": self.origin_unix}

    def to_chrome(self, step):
        meta = self.meta(step)
        pid = meta["rank"]
        out = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                "args": {"name": f"rank {pid} (pipeline stage {meta['stage_id']})"}},
               {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}}]
        out += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}
                for tid, name in THREADS.items()]
        cat = {COMPUTE: "compute", P2P: "p2p", STEP: "step"}
        for name, tid, start, end, args in self.events:
            out.append({"name": name, "cat": cat[tid], "ph": "X", "pid": pid, "tid": tid,
                        "ts": round((start - self.origin) * 1e6, 3), "dur": round((end - start) * 1e6, 3),
                        "args": args})
        return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": meta}

    def write(self, trace_dir, step):
        doc = self.to_chrome(step)
        os.makedirs(trace_dir, exist_ok=True)
        path = trace_path(trace_dir, step, doc["otherData"]["rank"])
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as fh:
            json.dump(doc, fh, separators=(",", ":"))
        os.replace(tmp, path)
        return path


class TraceMixin:
    """Per-iteration op tracing for a PipelineEngine subclass (put it first in the bases)."""

    _tracer = None

    def set_trace_dir(self, path):
        """Trace the following iterations into `path` (None: stop tracing)."""
        self._config.pipeline["trace_dir"] = path

    def _exec_schedule(self, pipe_schedule):
        trace_dir = self._config.pipeline.get("trace_dir")
        if not trace_dir or not torch.is_grad_enabled():  # eval runs under no_grad: not traced
            return super()._exec_schedule(pipe_schedule)
        step = self.global_steps
        tracer = self._tracer = IterationTrace(self)
        self._INSTRUCTION_MAP = tracer.wrap(type(self)._INSTRUCTION_MAP)  # shadows the class map
        try:
            super()._exec_schedule(pipe_schedule)
        finally:
            del self._INSTRUCTION_MAP
            self._tracer = None
        tracer.write(trace_dir, step)

    def _trace_wait(self, fn, key):
        """fn(key), recorded as a receive wait when tracing."""
        tracer = self._tracer
        if tracer is None:
            return fn(key)
        start = time.perf_counter()
        out = fn(key)
        tracer.wait(key, start, time.perf_counter())
        return out


_TRACED = {}


def traced_engine(cls):
    """`cls` (a PipelineEngine class) with TraceMixin in front."""
    if cls not in _TRACED:
        _TRACED[cls] = type(f"Traced{cls.__name__}", (TraceMixin, cls), {})
    return _TRACED[cls]


# -- reading -------------------------------------------------------------------------------------

def steps(trace_dir: str) -> list[int]:
    """Steps for which trace_dir holds files, ascending."""
    found = {int(m.group(1)) for m in map(FILE_RE.search, glob.glob(os.path.join(trace_dir, "step*_rank*.json")))
             if m}
    return sorted(found)


@dataclass
class RankTrace:
    meta: dict
    events: list  # Chrome "X" events, "ts"/"dur" in seconds on the merged clock

    @property
    def rank(self):
        return self.meta["rank"]

    def of(self, cat):
        return [e for e in self.events if e["cat"] == cat]

    def compute_ops(self) -> list[tuple[Op, float, float]]:
        out = []
        for e in self.of("compute"):
            a = e["args"]
            out.append((Op(a["kind"], a["replica"], a["stage"], a["mb"], a["seq"]), e["ts"], e["ts"] + e["dur"]))
        return out


def load_iteration(trace_dir: str, step: int | None = None) -> list[RankTrace]:
    """The rank files of one step (default: the last one), on one clock, sorted by rank.

    Times become seconds from the earliest origin: on the shared monotonic clock when all files
    come from one host, else from each rank's barrier-aligned origin."""
    if step is None:
        all_steps = steps(trace_dir)
        if not all_steps:
            raise FileNotFoundError(f"no trace files (step*_rank*.json) in {trace_dir}")
        step = all_steps[-1]
    paths = sorted(glob.glob(os.path.join(trace_dir, f"step{step:06d}_rank*.json")))
    if not paths:
        raise FileNotFoundError(f"no trace files for step {step} in {trace_dir}")
    docs = []
    for path in paths:
        with open(path) as fh:
            docs.append(json.load(fh))
    one_host = len({d["otherData"]["host"] for d in docs}) == 1
    first = min(d["otherData"]["origin_perf_counter"] for d in docs)
    traces = []
    for d in docs:
        meta = d["otherData"]
        shift = meta["origin_perf_counter"] - first if one_host else 0.0
        events = [dict(e, ts=e["ts"] * 1e-6 + shift, dur=e["dur"] * 1e-6)
                  for e in d["traceEvents"] if e.get("ph") == "X"]
        traces.append(RankTrace(meta, sorted(events, key=lambda e: e["ts"])))
    ranks = [t.meta["pp"] * t.meta["dp"] for t in traces][:1]
    if ranks and len(traces) != ranks[0]:
        raise FileNotFoundError(f"step {step} in {trace_dir}: {len(traces)} rank files, expected {ranks[0]}")
    return sorted(traces, key=lambda t: t.rank)


def merge(traces: list[RankTrace]) -> dict:
    """One Chrome trace holding every rank (times on the merged clock, microseconds)."""
    out = []
    for t in traces:
        pid = t.rank
        out += [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                 "args": {"name": f"rank {pid} (pipeline stage {t.meta['stage_id']})"}},
                {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}}]
        out += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}
                for tid, name in THREADS.items()]
        out += [dict(e, ts=round(e["ts"] * 1e6, 3), dur=round(e["dur"] * 1e6, 3)) for e in t.events]
    meta = dict(traces[0].meta)
    for key in ("rank", "stage_id", "origin_perf_counter", "origin_unix"):
        meta.pop(key, None)
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": meta}


def first_pipeline(traces: list[RankTrace]) -> list[RankTrace]:
    """One trace per pipeline stage (the lowest global rank of each), in stage order."""
    by_stage = {}
    for t in traces:
        by_stage.setdefault(t.meta["stage_id"], t)
    return [by_stage[s] for s in sorted(by_stage)]


@dataclass
class Measured:
    makespan: float       # first compute start to last compute end, all ranks (seconds)
    busy: list            # compute time per rank
    bubble: list          # (makespan - busy) / makespan per rank
    span: float           # first event start to last event end (all instructions, seconds)

    @property
    def bubble_ratio(self):
        return max(self.bubble)


def measure(traces: list[RankTrace]) -> Measured:
    """Bubble as DESIGN.md defines it, from the compute events of every rank."""
    ops = [t.compute_ops() for t in traces]
    start = min(s for lst in ops for _, s, _ in lst)
    end = max(e for lst in ops for _, _, e in lst)
    makespan = end - start
    busy = [sum(e - s for _, s, e in lst) for lst in ops]
    span = (max(e["ts"] + e["dur"] for t in traces for e in t.events)
            - min(e["ts"] for t in traces for e in t.events))
    return Measured(makespan, busy, [(makespan - b) / makespan for b in busy], span)


def to_schedule(traces: list[RankTrace]) -> Schedule:
    """The executed op order of the first pipeline as a Schedule (for simulate and pictures)."""
    pipe = first_pipeline(traces)
    m = pipe[0].meta
    ranks = [[op for op, _, _ in t.compute_ops()] for t in pipe]
    return Schedule(m["schedule"], m["pp"], m["micro_batches"], m["replicas"], m["stages"], m["seq_splits"],
                    [list(row) for row in m["placement"]], ranks)


def median_costs(traces: list[RankTrace]) -> dict:
    """Median measured duration per op kind, scaled to one 1F1B stage (DESIGN.md's TF, TB, TW)."""
    m = traces[0].meta
    scale = m["stages"] / m["pp"] * m["seq_splits"]
    durs = {}
    for t in traces:
        for op, s, e in t.compute_ops():
            durs.setdefault(op.kind, []).append(e - s)
    return {k: statistics.median(v) * scale for k, v in durs.items()}
