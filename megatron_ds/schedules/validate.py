"""Proves an op list is runnable: complete, placed, ordered by the IR's dependencies, deadlock free."""
from __future__ import annotations

from collections import Counter

from .deps import UnitIndex
from .ir import Schedule, ScheduleError
from .kinds import ACT, B, BW, COMPLETE, F, GRAD, VOCAB, W


def validate(schedule: Schedule) -> None:
    """Raises ScheduleError naming the first broken rule (and the op that breaks it)."""
    _check_shape(schedule)
    _check_ops(schedule)
    _check_complete(schedule)
    index = UnitIndex(schedule)
    _check_overlap(schedule, index)
    _check_local_order(schedule, index)
    _check_no_deadlock(schedule, index)


def _check_shape(s: Schedule) -> None:
    for key in ("pp", "micro_batches", "replicas", "stages", "seq_splits"):
        if getattr(s, key) < 1:
            raise ScheduleError(f"{key} must be >= 1 ({key}={getattr(s, key)})")
    if len(s.ranks) != s.pp:
        raise ScheduleError(f"schedule has {len(s.ranks)} rank lists for pp={s.pp}")
    if len(s.placement) != s.replicas:
        raise ScheduleError(f"placement has {len(s.placement)} rows for replicas={s.replicas}")
    for rep, row in enumerate(s.placement):
        if len(row) != s.stages:
            raise ScheduleError(f"placement[{rep}] has {len(row)} entries for stages={s.stages}")
        bad = [r for r in row if not 0 <= r < s.pp]
        if bad:
            raise ScheduleError(f"placement[{rep}] names rank {bad[0]} outside 0..{s.pp - 1}")


def _check_ops(s: Schedule) -> None:
    for r, i, op in s.ops():
        where = f"rank {r} op #{i} {op}"
        if not 0 <= op.replica < s.replicas:
            raise ScheduleError(f"{where}: replica outside 0..{s.replicas - 1}")
        if op.kind.traits.vocab:
            if not s.vocab_parallel:
                raise ScheduleError(f"{where}: a vocabulary pass in a schedule without vocab_parallel")
            if op.stage != r:
                raise ScheduleError(f"{where}: vocabulary slice {op.stage} lives on rank {op.stage}")
        elif not 0 <= op.stage < s.stages:
            raise ScheduleError(f"{where}: stage outside 0..{s.stages - 1}")
        if not 0 <= op.mb < s.micro_batches:
            raise ScheduleError(f"{where}: mb outside 0..{s.micro_batches - 1}")
        if not 0 <= op.seq < s.seq_splits:
            raise ScheduleError(f"{where}: seq outside 0..{s.seq_splits - 1}")
        placed = r if op.kind.traits.vocab else s.rank_of(op.replica, op.stage)
        if placed != r:
            raise ScheduleError(f"{where}: stage {op.stage} of replica {op.replica} is placed on rank {placed}")


def _check_complete(s: Schedule) -> None:
    counts = Counter(op for _, _, op in s.ops())
    for op, n in counts.items():
        if n > 1:
            raise ScheduleError(f"{op} appears {n} times (each op must appear once)")
    replica_of: dict[int, int] = {}
    for op in counts:
        prev = replica_of.setdefault(op.mb, op.replica)
        if prev != op.replica:
            raise ScheduleError(f"micro-batch {op.mb} runs on replicas {prev} and {op.replica} "
                                "(each micro-batch belongs to one replica)")
    for mb in range(s.micro_batches):
        if mb not in replica_of:
            raise ScheduleError(f"micro-batch {mb} has no ops (every micro-batch 0..{s.micro_batches - 1} must run)")
    kinds: dict[tuple, set] = {}
    passes: dict[tuple, set] = {}   # the vocabulary passes, per (replica, slice, mb, seq)
    for op in counts:
        (passes if op.kind.traits.vocab else kinds).setdefault(op.unit, set()).add(op.kind)
    if s.vocab_parallel:
        for mb, rep in sorted(replica_of.items()):
            for q in range(s.seq_splits):
                for j in range(s.pp):
                    lack = sorted(VOCAB - passes.get((rep, j, mb, q), set()))
                    if lack:
                        raise ScheduleError(f"(replica {rep}, vocabulary slice {j}, mb {mb}, seq {q}) has no "
                                            f"{', '.join(lack)} (vocab_parallel: every rank runs EF, S, T, EW "
                                            "on its slice for every micro-batch)")
    for mb, rep in sorted(replica_of.items()):
        for stage in range(s.stages):
            for q in range(s.seq_splits):
                unit = (rep, stage, mb, q)
                have = kinds.get(unit, set())
                name = f"(replica {rep}, stage {stage}, mb {mb}, seq {q})"
                if have in COMPLETE:
                    continue
                if F not in have:
                    raise ScheduleError(f"{name} has no F (every unit needs one F)")
                if BW in have:
                    raise ScheduleError(f"{name} has both BW and B/W (one BW or one B plus one W)")
                if B not in have:
                    raise ScheduleError(f"{name} has no backward (needs one BW or one B plus one W)")
                raise ScheduleError(f"{name} has a {B if W not in have else W} but no "
                                    f"{W if W not in have else B} (a split backward needs both)")


def _check_local_order(s: Schedule, index: UnitIndex) -> None:
    # A dependency on the same rank listed later can never be met: say so plainly
    # rather than reporting it as a deadlock.
    for r, i, op in s.ops():
        for dep in index.deps(op):
            dr, di = index.where[dep]
            if dr == r and di > i:
                raise ScheduleError(f"rank {r} runs {op} (op #{i}) before its dependency {dep} (op #{di})")


def _check_overlap(s: Schedule, index: UnitIndex) -> None:
    """An overlapped unit is a forward and a backward (B or BW) of two other units, next to each other in
    the rank's list; each op is in one unit at most. Neither may wait for the other (each side's
    dependencies must all be met before the unit starts: the deadlock check walks units)."""
    if s.overlap is None:
        return
    if len(s.overlap) != s.pp:
        raise ScheduleError(f"overlap has {len(s.overlap)} rows for pp={s.pp} (one list of positions per rank)")
    for r, row in enumerate(s.overlap):
        lst, seen = s.ranks[r], set()
        for i in sorted(row):
            where = f"overlap: rank {r} position {i}"
            if not 0 <= i < len(lst) - 1:
                raise ScheduleError(f"{where} names no pair of ops (the rank runs {len(lst)} ops; a unit is "
                                    "ops i and i+1)")
            if i in seen or i - 1 in seen:
                raise ScheduleError(f"{where}: op #{i} is already in the unit at position {i if i in seen else i - 1} "
                                    "(an op runs in one overlapped unit at most)")
            seen.add(i)
            a, b = lst[i], lst[i + 1]
            if {a.kind.traits.consumes, b.kind.traits.consumes} != {ACT, GRAD}:  # F, and B or BW
                raise ScheduleError(f"{where}: {a} and {b} are no forward and backward (an overlapped unit is "
                                    "one F and one B or BW)")
            if b in index.deps(a) or a in index.deps(b):
                raise ScheduleError(f"{where}: {a} and {b} depend on each other (an overlapped unit runs the "
                                    "forward and backward of two independent units)")


def _check_no_deadlock(s: Schedule, index: UnitIndex) -> None:
    units = [s.units(r) for r in range(s.pp)]
    pos = [0] * s.pp
    done: set = set()
    remaining = sum(len(u) for u in units)
    while remaining:
        progressed = False
        for r in range(s.pp):
            # an overlapped unit starts when every dependency of both its ops is met
            while pos[r] < len(units[r]) and all(d in done for op in units[r][pos[r]] for d in index.deps(op)):
                done.update(units[r][pos[r]])
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ScheduleError("deadlock: " + _describe_cycle(s, index, units, pos, done))


def _describe_cycle(s: Schedule, index: UnitIndex, units: list, pos: list[int], done: set) -> str:
    def waits(r: int):
        op, dep = next((op, d) for op in units[r][pos[r]] for d in index.deps(op) if d not in done)
        return op, dep, index.where[dep][0]

    start = next(r for r in range(s.pp) if pos[r] < len(units[r]))
    seen: list[int] = []
    r = start
    while r not in seen:
        seen.append(r)
        r = waits(r)[2]
    cycle = seen[seen.index(r):]
    parts = []
    for rr in cycle:
        op, dep, owner = waits(rr)
        parts.append(f"rank {rr} waits at {op} for {dep} on rank {owner}")
    return "; ".join(parts)
