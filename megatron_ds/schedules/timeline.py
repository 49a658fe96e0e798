"""Reading op traces (pure data, no torch): the files pipe/trace.py records, one Chrome/Perfetto
trace per rank and iteration, loaded onto one clock, merged, measured and turned back into the
Schedule the ranks ran (for the simulator and the pictures).

Each file is a JSON object: "ph": "X" events with pid = global rank and times in microseconds,
on three threads per rank (0 compute, 1 p2p, 2 step); "otherData" holds the run's metadata
(FORMAT). A compute event's args name its op (kind, replica, stage, mb, seq). The two ops of an overlapped
unit (Schedule.overlap) are two compute events, in the rank's list order, each spanning the whole unit, with
args "overlapped": true (absent on every other op: readers take its absence as false).
"""
from __future__ import annotations

import glob
import os
import re
import statistics
from dataclasses import dataclass

from megatron_ds.files import read_json

from .ir import Op, Schedule

FORMAT = "megatron_ds-trace-1"
COMPUTE, P2P, STEP = 0, 1, 2
THREADS = {COMPUTE: "compute", P2P: "p2p", STEP: "step"}
FILE_RE = re.compile(r"step(\d+)_rank(\d+)\.json$")


def trace_path(trace_dir: str, step: int, rank: int) -> str:
    return os.path.join(trace_dir, f"step{step:06d}_rank{rank:05d}.json")


def op_of(event: dict) -> Op:
    """The op a compute event ran."""
    a = event["args"]
    return Op(a["kind"], a["replica"], a["stage"], a["mb"], a["seq"])


def chrome_header(pid: int, stage_id: int) -> list[dict]:
    """The metadata events that name a rank's process and threads in Perfetto."""
    out = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
            "args": {"name": f"rank {pid} (pipeline stage {stage_id})"}},
           {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}}]
    return out + [{"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}
                  for tid, name in THREADS.items()]


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
        return [(op_of(e), e["ts"], e["ts"] + e["dur"]) for e in self.of("compute")]

    def overlap_positions(self) -> list[int]:
        """The positions in compute_ops where an overlapped unit starts: flagged events, two by two."""
        flags = [bool(e["args"].get("overlapped")) for e in self.of("compute")]
        out, i = [], 0
        while i < len(flags) - 1:
            if flags[i] and flags[i + 1]:
                out.append(i)
                i += 2
            else:
                i += 1
        return out

    def busy(self) -> float:
        """Compute time: the union of the compute events' spans (an overlapped unit's two events count once)."""
        total, reach = 0.0, float("-inf")
        for _, s, e in sorted(self.compute_ops(), key=lambda x: x[1]):
            total += max(0.0, e - max(s, reach))
            reach = max(reach, e)
        return total


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
    docs = [read_json(path, f"trace file {path}") for path in paths]
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
        out += chrome_header(t.rank, t.meta["stage_id"])
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
    busy = [t.busy() for t in traces]
    span = (max(e["ts"] + e["dur"] for t in traces for e in t.events)
            - min(e["ts"] for t in traces for e in t.events))
    return Measured(makespan, busy, [(makespan - b) / makespan for b in busy], span)


def to_schedule(traces: list[RankTrace]) -> Schedule:
    """The executed op order of the first pipeline as a Schedule (for simulate and pictures)."""
    pipe = first_pipeline(traces)
    m = pipe[0].meta
    ranks = [[op for op, _, _ in t.compute_ops()] for t in pipe]
    overlap = [t.overlap_positions() for t in pipe]
    return Schedule(m["schedule"], m["pp"], m["micro_batches"], m["replicas"], m["stages"], m["seq_splits"],
                    [list(row) for row in m["placement"]], ranks, overlap=overlap if any(overlap) else None)


def median_costs(traces: list[RankTrace]) -> dict:
    """Median measured duration per op kind, scaled to one 1F1B stage (DESIGN.md's TF, TB, TW); the ops of
    overlapped units (whose events span both) are left out."""
    m = traces[0].meta
    scale = m["stages"] / m["pp"] * m["seq_splits"]
    durs = {}
    for t in traces:
        for e in t.of("compute"):
            if not e["args"].get("overlapped"):
                durs.setdefault(op_of(e).kind, []).append(e["dur"])
    return {k: statistics.median(v) * scale for k, v in durs.items()}
