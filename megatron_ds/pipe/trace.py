"""Recording op traces: when each compute and communication instruction of an iteration really ran.

`"pipeline": {"trace_dir": PATH}` in the ds_config gives the engine a Tracer that records, for
each training iteration, the start and end of every instruction the engine executes: compute
ops (F, B, W, BW with replica, stage, micro-batch and segment), point-to-point waits (receive
waits inside compute ops, send completion, DeepSpeed's blocking sends/receives and batched
commits), micro-batch loading, gradient reductions and the optimizer step. Each rank writes one
Chrome/Perfetto trace per iteration to PATH/step{N:06d}_rank{R:05d}.json, atomically (written
aside, then renamed); megatron_ds.schedules.timeline reads them, tools/trace_to_png.py draws them.

Times are time.perf_counter() relative to an origin taken right after a barrier at the start
of the iteration, so the files of all ranks line up. The absolute origin and the host name
are kept as well: when every file comes from one host, `load_iteration` aligns the ranks on
the shared monotonic clock instead (exact, no barrier skew).

A compute op's event starts when its input has arrived: a receive the op waits on is its own
"p2p" event, so compute events show the work and p2p events the waiting. Each op of an overlapped
unit (OverlappedOps) is a compute event spanning the unit, its args "overlapped": true
(schedules/timeline.py reads the units back).

The seam: an engine class routes its instruction map through `through_tracer` once, at class
definition, and brackets `_exec_schedule` with `self.tracer.iteration(self)`. Its tracer
records nothing while its trace_dir is None (`Tracer()`, the default).
"""
from __future__ import annotations

import json
import os
import socket
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe.dualpipev import DualPipeVEngine
from deepspeed.runtime.pipe.engine import PipelineEngine

from megatron_ds.files import write_atomic
from megatron_ds.schedules import Op
from megatron_ds.schedules.kinds import Kind
from megatron_ds.schedules.timeline import COMPUTE, FORMAT, P2P, STEP, THREADS, chrome_header, trace_path

from .deepspeed import ds_internals as ds
from .instructions import INSTRUCTION_TO_KIND, OverlappedOps
from .parallel.sequence_parallel import SequenceParallelPipelineEngine

# Instruction class name -> op kind, for our instructions and DeepSpeed's.
COMPUTE_KINDS = {**INSTRUCTION_TO_KIND, "ForwardPass": Kind.F, "BackwardPass": Kind.BW}
OVERLAPPED = OverlappedOps.__name__
P2P_INSTRUCTIONS = {"SendActivation", "RecvActivation", "SendGrad", "RecvGrad", "CommitP2P", "FinishIteration"}


class Tracer:
    """Records an engine's training iterations into `trace_dir` (None: records nothing).
    Evaluation runs under no_grad and is never recorded."""

    def __init__(self, trace_dir: str | None = None):
        self.trace_dir = trace_dir
        self.listener = None  # called with each recorded IterationTrace (schedule "auto" times ops so)
        self._current = None  # the IterationTrace being recorded
        self.running = None  # (instruction name, kwargs) of the instruction under way

    @contextmanager
    def iteration(self, engine):
        if not (self.trace_dir or self.listener) or not torch.is_grad_enabled():
            yield
            return
        trace_dir, step, listener = self.trace_dir, engine.global_steps, self.listener
        self._current = IterationTrace(engine)
        try:
            yield
        finally:
            current, self._current = self._current, None
        if trace_dir:
            current.write(trace_dir, step)
        if listener:
            listener(current)

    def instruction(self, name, fn, engine, kwargs):
        # kept when the instruction raises: an out-of-memory report names the op (training/faults/out_of_memory.py)
        self.running = (name, kwargs)
        if torch.autograd._profiler_enabled():  # --profile: the op's name above its kernels in torch.profiler
            with torch.profiler.record_function(profile_label(name, engine, kwargs)):
                out = self._run(name, fn, engine, kwargs)
        else:
            out = self._run(name, fn, engine, kwargs)
        self.running = None
        return out

    def _run(self, name, fn, engine, kwargs):
        if self._current is None:
            return fn(engine, **kwargs)
        return self._current.run(name, fn, engine, kwargs)

    def wait(self, fn, key):
        """fn(key), recorded as a receive wait."""
        if self._current is None:
            return fn(key)
        start = time.perf_counter()
        out = fn(key)
        self._current.wait(key, start, time.perf_counter())
        return out


def profile_label(name, engine, kwargs) -> str:
    """A schedule op as its traces name it ("F3", "B1.2" ..., an overlapped unit "F3+BW1"), else the instruction's
    class name."""
    kind, sched = COMPUTE_KINDS.get(name), getattr(engine, "sched", None)
    if name == OVERLAPPED and sched is not None:
        return "+".join(sched.op_label(engine.stage_id, op) for op in kwargs["ops"])
    if kind is None or "stage" not in kwargs or sched is None:
        return name
    op = Op(kind, kwargs["replica"], kwargs["stage"], kwargs["mb"], kwargs.get("seq", 0))
    return sched.op_label(engine.stage_id, op)


def through_tracer(instruction_map: dict) -> dict:
    """An engine class's instruction map with every handler run through the engine's tracer."""
    def routed(name, fn):
        def run(engine, **kwargs):
            return engine.tracer.instruction(name, fn, engine, kwargs)
        return run
    return {cls: routed(cls.__name__, fn) for cls, fn in instruction_map.items()}


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

    def run(self, name, fn, engine, kwargs):
        self.resume = None
        start = time.perf_counter()
        fn(engine, **kwargs)
        self.instruction(name, kwargs, start, time.perf_counter())

    def instruction(self, name, kwargs, start, end):
        kind = COMPUTE_KINDS.get(name)
        if name == OVERLAPPED:
            start = start if self.resume is None else max(start, self.resume)
            for op in kwargs["ops"]:
                label, args = self._op(op.kind, {"replica": op.replica, "stage": op.stage, "mb": op.mb, "seq": op.seq})
                self.events.append((label, COMPUTE, start, end, {**args, "overlapped": True}))
        elif kind is not None:
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
        settings = getattr(getattr(eng, "plan", None), "settings", None)
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
        out = chrome_header(pid, meta["stage_id"])
        for name, tid, start, end, args in self.events:
            out.append({"name": name, "cat": THREADS[tid], "ph": "X", "pid": pid, "tid": tid,
                        "ts": round((start - self.origin) * 1e6, 3), "dur": round((end - start) * 1e6, 3),
                        "args": args})
        return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": meta}

    def write(self, trace_dir, step):
        doc = self.to_chrome(step)
        os.makedirs(trace_dir, exist_ok=True)
        path = trace_path(trace_dir, step, doc["otherData"]["rank"])
        write_atomic(path, json.dumps(doc, separators=(",", ":")), fsync=False)
        return path



def _traced(base):
    """`base`, one of DeepSpeed's own engine classes, unchanged but for the tracer."""
    class Traced(base):
        _INSTRUCTION_MAP = through_tracer(ds.instruction_map(base))

        def __init__(self, *args, tracer: Tracer, **kwargs):
            self.tracer = tracer
            super().__init__(*args, **kwargs)

        def _exec_schedule(self, pipe_schedule):
            with self.tracer.iteration(self):
                super()._exec_schedule(pipe_schedule)

    Traced.__name__ = Traced.__qualname__ = f"Traced{base.__name__}"
    return Traced


TracedPipelineEngine = _traced(PipelineEngine)    # TrainSchedule's 1F1B, the baseline
TracedDualPipeVEngine = _traced(DualPipeVEngine)
TracedSequenceParallelPipelineEngine = _traced(SequenceParallelPipelineEngine)  # built by bench/schedules.py only
