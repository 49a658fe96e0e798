"""Order ops by list scheduling against nominal costs.

Some schedules (ZB-H2's parallelogram, BitPipe's two interleaved V's and their junctions)
are easiest to state as a policy: whenever a rank is free, run the most urgent op whose
inputs are ready. Playing that policy out with nominal op times gives a fixed order per
rank, which is all the IR records; the order stays valid for any real costs, it is only
tuned for the nominal ones.
"""
from __future__ import annotations

import dataclasses
import heapq
from typing import Callable, Sequence

from ..deps import UnitIndex
from ..ir import Op, Schedule, ScheduleError

Chooser = Callable[[int, list[Op], "State"], "Op | None"]


class State:
    """What a policy may look at when it picks the next op of a rank."""

    def __init__(self, pp: int):
        self.time = 0.0
        self.in_flight = [0.0] * pp   # activation held per rank (policy's own units)
        self.done: list[list[Op]] = [[] for _ in range(pp)]


def list_schedule(skeleton: Schedule, work: Sequence[Sequence[Op]],
                  duration: Callable[[Op], float], choose: Chooser,
                  memory: Callable[[Op], float] | None = None,
                  candidates: Callable[[int], Sequence[Op]] | None = None) -> list[list[Op]]:
    """Per-rank orders of the ops in `work[r]`, chosen by `choose` whenever rank r is free.

    `choose(rank, ready, state)` gets the ops whose dependencies have finished and returns
    one of them, or None to leave the rank idle until something else finishes. A policy that
    only ever looks at a few of a rank's ops names them with `candidates(rank)` (faster).
    """
    probe = dataclasses.replace(skeleton, ranks=[list(w) for w in work])
    index = UnitIndex(probe)
    # Readiness by counting: an op is ready at t once none of its dependencies is unscheduled
    # and the last of them ends by t (what re-checking every dependency at every event gives).
    dependents: dict[Op, list[Op]] = {}
    unscheduled: dict[Op, int] = {}
    ready_at: dict[Op, float] = {}
    for w in work:
        for op in w:
            deps = index.deps(op)
            unscheduled[op], ready_at[op] = len(deps), 0.0
            for d in deps:
                dependents.setdefault(d, []).append(op)
    ends: list[float] = []   # a heap of the end times scheduled so far
    todo = [list(w) for w in work]
    state = State(skeleton.pp)
    events = [(0.0, r) for r in range(skeleton.pp) if todo[r]]
    heapq.heapify(events)
    waiting: set[int] = set()
    while events:
        t, r = heapq.heappop(events)
        state.time = t
        pool = todo[r] if candidates is None else candidates(r)
        ready = [op for op in pool if not unscheduled[op] and ready_at[op] <= t]
        op = choose(r, ready, state) if ready else None
        if op is None:
            while ends and ends[0] <= t:
                heapq.heappop(ends)
            if ends:
                heapq.heappush(events, (ends[0], r))
            else:
                waiting.add(r)
            continue
        todo[r].remove(op)
        end = t + duration(op)
        heapq.heappush(ends, end)
        for nxt in dependents.get(op, ()):
            unscheduled[nxt] -= 1
            ready_at[nxt] = max(ready_at[nxt], end)
        state.done[r].append(op)
        if memory is not None:
            state.in_flight[r] += memory(op)
        if todo[r]:
            heapq.heappush(events, (end, r))
        # Ranks that found nothing to wait for get another look once this op ends.
        for w in sorted(waiting):
            heapq.heappush(events, (end, w))
        waiting.clear()
    stuck = [r for r in range(skeleton.pp) if todo[r]]
    if stuck:
        r = stuck[0]
        raise ScheduleError(f"{skeleton.name}: the ordering policy stalls on rank {r} "
                            f"with {len(todo[r])} ops left (first {todo[r][0]})")
    return state.done


def merge_queues(skeleton: Schedule, forwards: Sequence[Sequence[Op]],
                 backwards: Sequence[Sequence[Op]], duration: Callable[[Op], float],
                 caps: Sequence[float], weights: Sequence[Sequence[Op]] | None = None,
                 w_caps: Sequence[float] | None = None,
                 footprint: dict[str, float] | None = None) -> list[list[Op]]:
    """Interleave fixed per-rank forward and backward orders (and optional W's).

    When rank r is free it runs its next backward if that is ready (it unblocks the
    previous rank and frees memory), else its next forward if ready and fewer than
    caps[r] forwards are waiting for their backward, else its next W (W's only fill
    time that would otherwise be idle, unless more than w_caps[r] are held back, which
    would let their memory grow with the number of micro-batches).

    `footprint` is what each kind adds to the count the caps bound (default: a forward
    counts 1 until its backward, W's count nothing); a forward runs only if it keeps the
    count within caps[r].
    """
    pp = skeleton.pp
    queues = [[list(forwards[r]), list(backwards[r]), list(weights[r]) if weights else []]
              for r in range(pp)]
    heads = [[0, 0, 0] for _ in range(pp)]

    def step(op: Op) -> float:
        # By default a forward holds a micro-batch until its input-gradient backward.
        return footprint[op.kind] if footprint else op.kind.traits.memory[0]

    def choose(r: int, ready: list[Op], state: State):
        ready_set = set(ready)
        fq, bq, wq = queues[r]
        h = heads[r]
        picks = []
        if h[1] < len(bq) and bq[h[1]] in ready_set:
            picks.append(1)
        held = h[1] - h[2]
        if w_caps is not None and held > w_caps[r] and wq[h[2]] in ready_set:
            picks.append(2)
        if (h[0] < len(fq) and fq[h[0]] in ready_set
                and state.in_flight[r] + step(fq[h[0]]) <= caps[r] + 1e-9):
            picks.append(0)
        if h[2] < len(wq) and wq[h[2]] in ready_set:
            picks.append(2)
        if not picks:
            return None
        which = picks[0]
        op = queues[r][which][h[which]]
        h[which] += 1
        return op

    work = [list(forwards[r]) + list(backwards[r]) + (list(weights[r]) if weights else [])
            for r in range(pp)]
    return list_schedule(skeleton, work, duration, choose, memory=step)
