"""Vocabulary parallelism (Yeung et al., MLSys 2025) added to any schedule: the embedding and the
output layer sliced over the p ranks by vocabulary, their passes (EF, S, T, EW; kinds.py) placed
on every rank among the schedule's own ops.

The paper places its S and T passes in 1F1B and V-Half by hand-made building blocks. Here one
policy places them in any schedule, played out by list scheduling at nominal costs (the order
is all the IR keeps; it stays valid at any costs). When a rank is free:
- a T goes first once `hold` slices of logits wait for theirs (the logits held stay bounded);
- then a ready S: the loss stage's backward of that micro-batch waits for every rank's S (the
  all-reduce of the softmax statistics, the paper's barrier), so an S late on one rank stalls it;
- an EF when stage 0's forward of its micro-batch is at most one forward away (stage 0 waits for
  the sum of every slice's rows); an EW once `hold` of them are ready;
- then the schedule's own next op, in the schedule's order;
- else a T, EW or EF fills time the rank would idle.
The barrier still stalls the loss stage's backward for up to one op of every other rank, so the
order can first hold `extra` more micro-batches on every rank (each input-gradient backward moved
after the next `extra` forwards: the paper's longer warm-up, Vocab-1's p+1 and p+2 under 1F1B):
the loss stage then computes the next forward while the other ranks' S passes finish. Of every
(order, extra, hold) the shortest at the nominal costs wins (ties within 1 %: the fewest logits
held). The nominal costs: TF = TB = TW per 1F1B stage, the whole-vocabulary head 1/4 and 1 stage
(judged at both), the embedding 1/10.
"""
from __future__ import annotations

from ..deps import UnitIndex
from ..ir import Op, Schedule, ScheduleError
from ..kinds import EF, EW, F, GRAD, S, T, VOCAB
from ..simulate import simulate
from .greedy import list_schedule

HOLDS = (1, 2)      # T's (slices of logits) or EW's a rank may leave waiting before they go first
TIE = 0.01          # orders this close to the shortest count as tied: the one holding fewer logits wins
EXTRAS = (0, 1, 2)  # micro-batches more in flight per rank, to hide the barrier (the shortest order wins)
NOMINAL_HEADS = (0.25, 1.0)   # whole-vocabulary head (F, B, W) times, in 1F1B stages: judged at both
EMBED = 0.1                   # whole-vocabulary embedding (F, B, W) times, in 1F1B stages


def add_vocab_passes(base: Schedule, *, others=(), extras=EXTRAS, holds=HOLDS) -> Schedule:
    """`base` with every rank's vocabulary passes placed in its op lists (vocab_parallel=True): of the
    orders for `base` and each of `others` (the same schedule's other orders, e.g. V-Half's at one
    micro-batch more memory), with each number of `extras` and each of `holds`, the one holding the
    fewest logits among those within TIE of the shortest at the nominal costs."""
    scored = []
    for order in (base, *others):
        for extra in extras:
            for hold in holds:
                try:
                    candidate = _place(order, extra, hold)
                except ScheduleError:   # held-back backwards can close a cycle with a later forward
                    if extra == 0:
                        raise
                    continue
                runs = [simulate(candidate, check=False, head=(h, h, h), embed=(EMBED,) * 3, head_memory=1.0)
                        for h in NOMINAL_HEADS]
                logits = simulate(candidate, check=False, act_size=(0.0, 0.0), head_memory=1.0).peak_memory_max
                scored.append((sum(r.makespan for r in runs), logits, runs[0].peak_memory_max, len(scored), candidate))
    shortest = min(score for score, *_ in scored)
    return min((c for c in scored if c[0] <= shortest * (1 + TIE)), key=lambda c: c[1:4])[-1]


def _place(base: Schedule, extra: int, hold: int) -> Schedule:
    pp, stages = base.pp, base.stages
    out = Schedule(base.name, pp, base.micro_batches, base.replicas, stages, base.seq_splits,
                   base.placement, [], base.segment_lengths, vocab_parallel=True)
    nominal = simulate(base, check=False)   # anchors: when the schedule itself reaches each unit
    last = base.loss_stage
    units = sorted({(op.replica, op.mb, op.seq) for _, _, op in base.ops()},
                   key=lambda u: nominal.start[Op(F, u[0], 0, u[1], u[2])])
    by_head = sorted(units, key=lambda u: nominal.end[Op(F, u[0], last, u[1], u[2])])
    index = UnitIndex(base)
    by_grad = sorted(units, key=lambda u: nominal.end[index.backward[(u[0], 0, u[1], u[2])]])
    queues = [{EF: [Op(EF, rep, r, mb, q) for rep, mb, q in units],
               S: [Op(S, rep, r, mb, q) for rep, mb, q in by_head],
               T: [Op(T, rep, r, mb, q) for rep, mb, q in by_head],
               EW: [Op(EW, rep, r, mb, q) for rep, mb, q in by_grad]} for r in range(pp)]
    first_forward = {Op(F, rep, 0, mb, q): i for i, (rep, mb, q) in enumerate(units)}
    own = [delay_backwards(list(ops), extra) for ops in base.ranks]
    started = [0]   # stage-0 forwards started so far (they pace the EF's)
    head = NOMINAL_HEADS[-1]
    costs = {S: 2 * head, T: head, EF: EMBED, EW: 2 * EMBED}
    per_stage = pp / stages

    def duration(op: Op) -> float:
        kind_cost = costs[op.kind] / pp if op.kind in VOCAB else per_stage * sum(op.kind.traits.cost)
        return kind_cost / base.seq_splits

    def choose(r: int, ready: list[Op], state) -> Op | None:
        ready_set = set(ready)
        q = queues[r]

        def take(kind):
            return q[kind].pop(0) if q[kind] and q[kind][0] in ready_set else None

        held = len(q[T]) - len(q[S])   # slices of logits this rank holds
        op = take(T) if held >= hold else None
        if op is None:
            op = take(S)
        if op is None and q[EF] and first_forward[Op(F, *_unit(q[EF][0]))] <= started[0] + 1:
            op = take(EF)
        if op is None and len(q[EW]) and sum(1 for o in q[EW][:hold] if o in ready_set) >= hold:
            op = take(EW)
        if op is None and own[r] and own[r][0] in ready_set:
            op = own[r].pop(0)
        for kind in (T, EW, EF):
            if op is None:
                op = take(kind)
        if op is not None and op in first_forward:
            started[0] += 1
        return op

    work = [list(own[r]) + [op for kind in (EF, S, T, EW) for op in queues[r][kind]] for r in range(pp)]
    def candidates(r: int) -> list[Op]:   # the heads of the queues, and the EW's `hold` counts
        q = queues[r]
        return own[r][:1] + q[S][:1] + q[EF][:1] + q[T][:1] + q[EW][:hold]

    out.ranks = list_schedule(out, work, duration, choose, candidates=candidates)
    return out


def _unit(op: Op) -> tuple[int, int, int, int]:
    return (op.replica, 0, op.mb, op.seq)


def delay_backwards(ops: list[Op], extra: int) -> list[Op]:
    """The rank's order with each input-gradient backward (B or BW) moved after the next `extra`
    forwards (after the last one, when fewer follow), its W's after it: `extra` more micro-batches
    in flight (the paper's longer warm-up), so the loss stage's backward, which waits on every
    rank's S pass, has forwards to overlap. (It can close a cycle with another rank's order; the
    caller then drops that order.)"""
    out: list[Op] = []
    held: list[list] = []   # [op, forwards still to pass]
    waiting_b: set = set()
    forwards_left = sum(1 for op in ops if op.kind is F)
    for op in ops:
        if op.kind is F:
            out.append(op)
            forwards_left -= 1
            for entry in held:
                entry[1] -= 1
            while held and held[0][1] <= 0:
                done = held.pop(0)[0]
                waiting_b.discard(done.unit)
                out.append(done)
        elif op.kind.traits.sends == GRAD and min(extra, forwards_left) > 0:
            held.append([op, min(extra, forwards_left)])
            waiting_b.add(op.unit)
        elif op.unit in waiting_b:   # a W whose B is held goes right after it
            held.append([op, 0])
        else:
            out.append(op)
    out.extend(entry[0] for entry in held)
    return out
