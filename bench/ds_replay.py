"""Ideal makespan of DeepSpeed's own pipeline schedules (TrainSchedule, DualPipeVSchedule).

Our simulator (megatron_ds.schedules.simulate) times op lists by their data dependencies.
DeepSpeed's engines also wait on their communication pattern, so this replays the very
instruction streams DeepSpeed's schedule classes yield, rank by rank: compute takes its
cost, communication takes no time but follows gloo's semantics - a send completes once the
peer has posted the matching receive and a receive once the peer has posted the send,
messages between a pair of ranks match in order; the stock engine's Send*/Recv* block on
the spot, DualPipeV queues them and a CommitP2P waits for its whole batch. For the stock
TrainSchedule this gives exactly (m+p-1)(TF+TB+TW), as simulate() does for our "1f1b".
"""
from __future__ import annotations

from deepspeed.runtime.pipe import schedule as ds

SENDS = {ds.SendActivation: "down", ds.SendGrad: "up"}
RECVS = {ds.RecvActivation: "up", ds.RecvGrad: "down"}


def _peer(rank, direction, phase, pp):
    """The rank a message goes to ("down": where activations flow) in the given phase."""
    step = 1 if (direction == "down") == (phase == 0) else -1
    return rank + step


def _program(sched, rank, pp, cost, batched):
    """[("compute", seconds, kind) | ("comm", [(op id, "send"|"recv")])] for one rank."""
    items, queued, counts = [], [], {}

    def op_id(src, dst):
        n = counts.get((src, dst), 0)
        counts[(src, dst)] = n + 1
        return (src, dst, n)

    for step in sched.steps():
        for cmd in step:
            phase = cmd.kwargs.get("phase", 0) or 0
            if type(cmd) in SENDS:
                entry = (op_id(rank, _peer(rank, SENDS[type(cmd)], phase, pp)), "send")
            elif type(cmd) in RECVS:
                src = _peer(rank, RECVS[type(cmd)], phase, pp)
                entry = (("recv", src, rank), "recv")
            elif isinstance(cmd, (ds.ForwardPass, ds.BackwardPass)):
                kind = "F" if isinstance(cmd, ds.ForwardPass) else "BW"
                items.append(("compute", cost(kind, phase), kind))
                continue
            elif isinstance(cmd, ds.CommitP2P):
                if queued:
                    items.append(("comm", queued))
                queued = []
                continue
            else:
                continue
            if batched:
                queued.append(entry)
            else:
                items.append(("comm", [entry]))
    if queued:
        items.append(("comm", queued))
    return items


def _match_receives(programs):
    """Give every receive the id of the send it matches (k-th send src->dst = k-th receive)."""
    counts = {}
    for rank, items in enumerate(programs):
        for item in items:
            if item[0] != "comm":
                continue
            for i, (oid, side) in enumerate(item[1]):
                if side == "recv":
                    _, src, dst = oid
                    n = counts.get((src, dst), 0)
                    counts[(src, dst)] = n + 1
                    item[1][i] = ((src, dst, n), "recv")


def replay(kind: str, pp: int, m: int, tf: float, tb: float, tw: float) -> float:
    """Makespan (first compute start to last compute end) of DeepSpeed's `kind` schedule,
    "1f1b" (TrainSchedule) or "dualpipev"; tf, tb, tw per 1F1B stage as in DESIGN.md."""
    if kind == "1f1b":
        scheds, batched, chunk = [ds.TrainSchedule(m, pp, r) for r in range(pp)], False, 1.0
    elif kind == "dualpipev":
        scheds, batched, chunk = [ds.DualPipeVSchedule(m, pp, r) for r in range(pp)], True, 0.5
    else:
        raise ValueError(f"unknown DeepSpeed schedule {kind!r}")
    cost = lambda k, _phase: chunk * (tf if k == "F" else tb + tw)  # noqa: E731
    programs = [_program(s, r, pp, cost, batched) for r, s in enumerate(scheds)]
    _match_receives(programs)
    posted = {}  # (op id, side) -> time the side was posted
    clock, pos = [0.0] * pp, [0] * pp
    first, last = float("inf"), 0.0
    while any(pos[r] < len(programs[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            while pos[r] < len(programs[r]):
                item = programs[r][pos[r]]
                if item[0] == "compute":
                    first = min(first, clock[r])
                    clock[r] += item[1]
                    last = max(last, clock[r])
                else:
                    for entry in item[1]:
                        posted.setdefault(entry, clock[r])
                    other = [(oid, "recv" if side == "send" else "send") for oid, side in item[1]]
                    if any(o not in posted for o in other):
                        break
                    clock[r] = max([clock[r]] + [posted[o] for o in other])
                pos[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"replay of {kind} p={pp} m={m} deadlocks at positions {pos}")
    return last - first
