"""`"schedule": "auto"`: pick the catalogued schedule with the smallest simulated makespan whose
peak activation memory fits a budget (pure data; the engine side is megatron_ds/pipe/auto.py).

Memory is in the simulator's unit: one micro-batch's activations on one 1F1B stage (1/p of the
layers), with W keeping half of it (simulate.DEFAULT_ACT). A schedule's peak memory depends on its
op order only, not on the op costs, so whether a candidate fits is known before anything is
measured: a budget no candidate fits is refused at start-up with the smallest one that would.

Candidates are every catalogue entry with its chunk-count variant (interleaved v=2) and its B/W
split where optional; Seq1F1B at each segment count of the run's `Cut`s (its segments hold their
tokens' share of the memory and cost their FLOPs' share of the time; its order is the token-capped
one the engine runs); plus, once costs are measured on a linear start, `zb_search`: zero-bubble's
heuristic at memory limits between ZB-H1's and ZB-H2's, and V-Half and V-Min built for the measured
costs (`costed`). The run starts on the first of `starts` that
fits: a candidate that splits the backward, so that F, B and W are timed separately (a segment's
times add up to its micro-batch's), those with one chunk per rank first (a probe and most choices
swap in place on them), each group in catalogue order.

Under vocabulary parallelism every candidate, searched ones included, carries the vocabulary passes
(generators/vocab.py), and the embedding's and head's costs are their measured EF, S, T and EW times
(measurement.model_costs). `head_memory` is one micro-batch's logits in the memory unit
(`logits_units`): with it in the budget, a schedule that holds more logits (the loss stage's F to
its W without vocabulary parallelism, each slice's S to its T with it) needs more memory.

A mixture of experts is costed layer by layer (measurement.moe_costs: a MoE layer's time told from a dense
one's, each candidate's stages charged the layers it holds) and its expert-parallel all-to-all is a named
quantity on the critical path of the MoE layers' F and B (ModelCosts.all_to_all); `describe` states both and
the all-to-all's share of the chosen step.

Overlap (`overlap=True` to `rank` and `decide`): each candidate that has an overlapped order
(catalog: `takes("overlap")`) is weighed with it too ("overlap=True" in its knobs), its units paying the host
time of their pieces (ModelCosts.piece_host). It is chosen only where its simulation is faster than every
plain candidate that fits; with no all-to-all there is nothing to hide and no overlapped order is weighed.
`overlap_verdict` says which way it went and why, for the log line.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from . import placement
from .catalog import CATALOG, build_schedule, takes
from .costs import ModelCosts, evaluate
from .generators.greedy import merge_queues
from .generators.vocab import add_vocab_passes
from .measurement import Measured, model_costs
from .ir import Op, Schedule, ScheduleError
from .kinds import B, F, W
from .validate import validate

SEQ_SPLITS = (2, 4)  # the segment counts Seq1F1B is weighed at
EPS = 1e-9


@dataclass(frozen=True)
class Cut:
    """The run's sequence cut into k Seq1F1B segments: their token counts and relative costs
    (seq_split.segment_costs: FLOPs), as the engine would cut it (pipe/plan/segments.segment_lengths)."""
    k: int
    lengths: tuple
    costs: tuple


@dataclass(frozen=True)
class Candidate:
    schedule: str
    knobs: tuple = ()  # sorted (key, value) pairs for build_schedule / the ds_config "pipeline" section

    @property
    def label(self) -> str:
        extra = " ".join(f"{k}={v}" for k, v in self.knobs)
        return f"{self.schedule} {extra}".strip()

    def section(self) -> dict:
        """The ds_config "pipeline" keys that select this candidate."""
        return {"schedule": self.schedule, **dict(self.knobs)}


def candidates(pp: int, m: int, num_layers: int, cuts: tuple = (), *,
               vocab_parallel: bool = False) -> list[tuple[Candidate, Schedule]]:
    """Every candidate that can run pp ranks, m micro-batches and num_layers layers; Seq1F1B at
    the segment counts of `cuts` (none: no Seq1F1B); with the vocabulary passes when `vocab_parallel`."""
    names = tuple(takes("vocab_parallel") if vocab_parallel else CATALOG)
    return list(_candidates(pp, m, num_layers, tuple(cuts), names, vocab_parallel))


@functools.lru_cache(maxsize=16)  # V-Half/V-Min and the vocabulary passes take seconds at pp=8; a new entry is a new key
def _candidates(pp: int, m: int, num_layers: int, cuts: tuple, names: tuple, vocab_parallel: bool) -> tuple:
    lengths = {c.k: list(c.lengths) for c in cuts}
    out = []
    for name in names:
        spec = CATALOG[name]
        splits = tuple(lengths) if spec.seq_splits else (1,)
        if not splits:
            continue
        for _, knobs in spec.variants(virtual_stages=2, seq_splits=splits, split=True):
            cand = Candidate(name, tuple(sorted(knobs.items())))
            try:
                schedule = build_schedule(name, pp, m, **knobs, segment_lengths=lengths.get(knobs.get("seq_splits")),
                                          vocab_parallel=vocab_parallel)
            except ScheduleError:
                continue
            if runs(schedule, num_layers):
                out.append((cand, schedule))
    return tuple(out)


def runs(schedule: Schedule, num_layers: int) -> bool:
    """Whether pipe/plan/plan.check_layers lets `num_layers` layers run it."""
    stages = schedule.stages
    return num_layers >= stages and not (num_layers % stages and stages > schedule.pp)


def peak_memory(schedule: Schedule, head_memory: float = 0.0) -> float:
    return evaluate(schedule, ModelCosts(head_memory=head_memory)).peak_memory_max


def memory_table(pp: int, m: int, num_layers: int, cuts: tuple = (), *, vocab_parallel: bool = False,
                 head_memory: float = 0.0, peak=None) -> list[tuple[Candidate, float]]:
    """`peak(schedule, head_memory)`: a schedule's peak memory (None: peak_memory; auto_recompute: a setting's)."""
    return [(c, (peak or peak_memory)(s, head_memory))
            for c, s in candidates(pp, m, num_layers, cuts, vocab_parallel=vocab_parallel)]


def linear(schedule: Schedule) -> bool:
    """One chunk per rank."""
    return schedule.stages == schedule.pp


def starts(pp: int, m: int, num_layers: int, cuts: tuple = (), *, vocab_parallel: bool = False) -> list[Candidate]:
    """The candidates a run may start on, in the order it tries them: those whose schedule splits the
    backward (W ops: F, B and W are timed apart), one chunk per rank first, each group in catalogue order."""
    split = [(c, s) for c, s in candidates(pp, m, num_layers, cuts, vocab_parallel=vocab_parallel)
             if any(op.kind is W for op in s.ranks[0])]
    return [c for c, s in sorted(split, key=lambda cs: not linear(cs[1]))]


def check_budget(budget: float, pp: int, m: int, num_layers: int, cuts: tuple = (), *, vocab_parallel: bool = False,
                 head_memory: float = 0.0) -> Candidate:
    """The schedule to start on; ScheduleError naming the smallest budget that fits when none does."""
    table = memory_table(pp, m, num_layers, cuts, vocab_parallel=vocab_parallel, head_memory=head_memory)
    memory = {c: mem for c, mem in table}
    first = starts(pp, m, num_layers, cuts, vocab_parallel=vocab_parallel)
    for cand in first:
        if memory[cand] <= budget + EPS:
            return cand
    smallest = min(mem for _, mem in table)
    start = min((memory[c] for c in first), default=float("inf"))
    if any(mem <= budget + EPS for _, mem in table):  # only schedules that fuse B and W fit: no W to time
        exc = ScheduleError(f"memory_budget {budget:.4g} fits no schedule that splits the backward "
                            f"({', '.join(c.label for c in first)}), needed to time F, B and W; the smallest "
                            f"budget that fits one is {start:g}")
    else:
        best = min(table, key=lambda cm: cm[1])[0]
        exc = ScheduleError(f"memory_budget {budget:.4g} (micro-batches of one stage's activations) fits no "
                            f"schedule at pp={pp}, {m} micro-batches; the smallest budget that fits is "
                            f"{max(smallest, start):g} ({best.label} needs {smallest:g}, the start-up "
                            f"schedule {start:g})")
    exc.smallest = max(smallest, start)
    raise exc


def probe(start: Candidate, budget: float, pp: int, m: int, num_layers: int, cuts: tuple = (), *,
          vocab_parallel: bool = False, head_memory: float = 0.0, peak=None) -> Candidate | None:
    """A Seq1F1B B/W schedule placed as the linear `start` whose ops are another size, that fits the
    budget (the most segments): the timing window alternates the two so that each op's fixed time
    can be told from its per-token time (`separate`). None: no such schedule. `peak`: memory_table's."""
    if not linear(dict(candidates(pp, m, num_layers, cuts, vocab_parallel=vocab_parallel))[start]):
        return None
    own = dict(start.knobs).get("seq_splits", 1)
    table = memory_table(pp, m, num_layers, cuts, vocab_parallel=vocab_parallel, head_memory=head_memory, peak=peak)
    fits = [c for c, mem in table if mem <= budget + EPS and c.schedule == "seq1f1b"
            and dict(c.knobs).get("split_backward") and dict(c.knobs)["seq_splits"] != own]
    return max(fits, key=lambda c: dict(c.knobs)["seq_splits"], default=None)


def zb_search(pp: int, m: int, cap: float, f: list, b: list, w: list, vocab_parallel: bool = False) -> Schedule:
    """Zero-bubble's heuristic for a memory limit and measured costs (ZB-H2's list scheduling,
    generators/zero_bubble.py, played out with the per-stage times `f`, `b`, `w` instead of unit
    ones): when a rank is free it runs its next B if ready, else its next F if the activations it
    holds stay within `cap` (F adds 1, B frees 1/2, W the other 1/2: the simulator's memory), else
    a W. ZB-H1 is cap = p at unit costs, ZB-H2 about 2p - 1. `vocab_parallel`: the vocabulary
    passes are then placed among its ops as in any catalogued schedule."""
    skeleton = Schedule(f"zb-search cap={cap:g}", pp, m, 1, pp, 1, placement.linear(pp), [])
    fwd, bwd, wgt = ([[Op(k, 0, r, mb) for mb in range(m)] for r in range(pp)] for k in (F, B, W))
    times = {F: f, B: b, W: w}
    skeleton.ranks = merge_queues(skeleton, fwd, bwd, lambda op: times[op.kind][op.stage], [cap] * pp,
                                  weights=wgt, w_caps=[pp - 1 + r for r in range(pp)],
                                  footprint={F: 1.0, B: -0.5, W: -0.5})
    validate(skeleton)
    return add_vocab_passes(skeleton) if vocab_parallel else skeleton


def searched(pp: int, m: int, budget: float, costs: ModelCosts,
             vocab_parallel: bool = False) -> list[tuple[Candidate, Schedule, dict]]:
    """zb_search at the budget and every whole memory limit from p up to it (at most 2p - 1)."""
    linear_order = Schedule("linear", pp, m, 1, pp, 1, placement.linear(pp), [], vocab_parallel=vocab_parallel)
    f, b, w = ([t + fixed for t in times] for times, fixed in zip(costs.op_times(linear_order), costs.op_overhead))
    top = min(budget, 2 * pp - 1)
    out = []
    for cap in sorted({top, *range(pp, int(top) + 1)}):
        args = {"cap": cap, "f": f, "b": b, "w": w, **({"vocab_parallel": True} if vocab_parallel else {})}
        try:  # the schedule that is simulated is the one schedule_maker builds from `args`
            schedule = zb_search(pp, m, **args)
        except ScheduleError:
            continue
        out.append((Candidate("zb-search", (("cap", cap),)), schedule, args))
    return out


def costed(pp: int, m: int, num_layers: int, costs: ModelCosts,
           vocab_parallel: bool = False) -> list[tuple[Candidate, Schedule, None]]:
    """The schedules whose op order depends on the costs (V-Half, V-Min), built for the measured
    ones: a layer's TF, TB, TW with each op's fixed time (a chunk op pays it once), relative."""
    op = [t + 2 * fixed for t, fixed in zip(costs.mean_op_times(pp), costs.op_overhead)]
    if len(set(op)) == 1:
        return []  # the catalogue's own order is built for equal costs
    op_costs = tuple(round(3 * t / sum(op), 3) for t in op)
    out = []
    for name in takes("op_costs"):
        try:
            schedule = build_schedule(name, pp, m, op_costs=op_costs, vocab_parallel=vocab_parallel)
        except ScheduleError:
            continue
        if runs(schedule, num_layers):
            out.append((Candidate(name, (("op_costs", op_costs),)), schedule, None))
    return out


def overlapped(pp: int, m: int, num_layers: int, pool: list) -> list[tuple[Candidate, Schedule, None]]:
    """The overlapped orders of the catalogued candidates in `pool` that have one (the same knobs, and
    "overlap": True)."""
    out = []
    for cand, _, args in pool:
        if args is not None or cand.schedule not in takes("overlap"):
            continue
        knobs = dict(cand.knobs)
        try:
            schedule = build_schedule(cand.schedule, pp, m, overlap=True, **knobs)
        except ScheduleError:
            continue
        if runs(schedule, num_layers):
            out.append((Candidate(cand.schedule, tuple(sorted({**knobs, "overlap": True}.items()))), schedule, None))
    return out


def has_all_to_all(costs: ModelCosts) -> bool:
    return any(x > 0 for t in costs.all_to_all for x in t)


def rank(pp: int, m: int, num_layers: int, budget: float, costs: ModelCosts, p2p: float = 0.0,
         search: bool = False, cuts: tuple = (), vocab_parallel: bool = False, knobs=None,
         overlap: bool = False) -> list[dict]:
    """Every candidate that fits, fastest first: {candidate, makespan, memory, search, all_to_all, recompute,
    overlap, hidden, host}; `search` adds zb_search's schedules (its "search" entry: zb_search's arguments but
    pp and m). The memory counts `costs.head_memory`; all_to_all is the most time one rank spends in it (MoE),
    hidden the most one rank's overlapped units hide of it and host what their pieces cost there. `knobs`
    (auto_recompute.Knobs): each candidate under each recompute setting, "recompute" naming it (else None).
    `overlap`: the overlapped orders too, where the model has an all-to-all to hide (equal times: plain first)."""
    pool = [(c, s, None) for c, s in candidates(pp, m, num_layers, cuts, vocab_parallel=vocab_parallel)]
    if overlap and has_all_to_all(costs) and not vocab_parallel:
        pool += overlapped(pp, m, num_layers, pool)
    pool += costed(pp, m, num_layers, costs, vocab_parallel)
    pool += searched(pp, m, budget, costs, vocab_parallel) if search else []
    shares = {c.k: c.costs for c in cuts}
    rows = []
    for cand, schedule, args in pool:
        sim = dict(p2p_latency=p2p, seq_costs=shares.get(schedule.seq_splits))
        results = ([(r, *knobs.evaluate(schedule, costs, r, **sim)) for r in knobs.settings] if knobs else
                   [(None, res, res.peak_memory_max) for res in [evaluate(schedule, costs, **sim)]])
        for recompute, res, memory in results:
            if memory <= budget + EPS:
                busiest = max(range(pp), key=lambda r: res.all_to_all_hidden[r])
                rows.append({"candidate": cand, "makespan": res.makespan, "memory": memory, "search": args,
                             "all_to_all": max(res.all_to_all), "recompute": recompute,
                             "overlap": bool(schedule.overlap), "hidden": res.all_to_all_hidden[busiest],
                             "host": res.overlap_host[busiest]})
    return sorted(rows, key=lambda r: (r["makespan"], r["memory"], r["search"] is not None, r["overlap"]))


def overlap_verdict(rows: list, costs: ModelCosts, budget: float) -> dict:
    """Whether the choice (rows[0] of `rank(..., overlap=True)`) overlaps, and why, as JSON-able data:
    {"overlap": bool, "why": text}. Yes only where an overlapped order fits and simulates faster than every
    plain one; the text names both, the all-to-all its units hide and what their pieces' host time costs."""
    if not has_all_to_all(costs):
        return {"overlap": False, "why": "no all-to-all to hide (no expert parallelism), so no overlapped order "
                                         "was weighed"}
    plain = next((r for r in rows if not r["overlap"]), None)
    over = next((r for r in rows if r["overlap"]), None)
    ms = lambda t: f"{t * 1e3:.1f} ms"  # noqa: E731
    host = f"{costs.piece_host * 1e3:.3f} ms of host time per piece"
    if over is None:
        return {"overlap": False, "why": f"no overlapped order fits the memory budget {budget:g}"}
    gain = f"hides {ms(over['hidden'])} of all-to-all on its busiest rank for {ms(over['host'])} of its pieces' host time"
    if plain is None or over["makespan"] < plain["makespan"] - EPS:
        against = f"against {plain['candidate'].label} {ms(plain['makespan'])}" if plain else "(no plain order fits)"
        return {"overlap": True, "why": f"{over['candidate'].label} {ms(over['makespan'])} {against}: it {gain} "
                                        f"({host})"}
    cause = ("its pieces' host time outweighs what it hides" if over["host"] >= over["hidden"] else
             "what it hides does not pay for the pairing's waits and its order")
    return {"overlap": False, "why": f"the fastest overlapped order, {over['candidate'].label}, "
                                     f"{ms(over['makespan'])} against {plain['candidate'].label} "
                                     f"{ms(plain['makespan'])}: it {gain} ({host}); {cause}"}


def schedule_maker(choice: dict):
    """None for a catalogued choice (the ds_config section builds it), else (pp, m) -> its schedule."""
    args = choice.get("search")
    return None if args is None else (lambda pp, m: zb_search(pp, m, **args))


def decide(pp: int, m: int, num_layers: int, budget: float, measured: Measured, cuts: tuple = (), *,
           vocab_parallel: bool = False, head_memory: float = 0.0, knobs=None, running=None,
           overlap: bool = False) -> dict:
    """The choice as plain JSON-able data (what rank 0 broadcasts). `knobs` (auto_recompute.Knobs): the
    recompute setting is chosen too (the entries' "recompute"), the times measured under `running`'s.
    `overlap`: the overlapped orders are candidates too (their pieces' host time measured.piece_host), and
    the decision's "overlap" says whether the choice overlaps and why (overlap_verdict)."""
    costs = dataclasses.replace(model_costs(measured, pp), head_memory=head_memory, piece_host=measured.piece_host)
    if knobs:
        costs = knobs.unrecomputed(costs, running)
    linear = len(measured.f) == pp  # searched schedules are linear: a swap from a linear start
    rows = rank(pp, m, num_layers, budget, costs, measured.p2p, search=linear, cuts=cuts, vocab_parallel=vocab_parallel,
                knobs=knobs, overlap=overlap)

    def entry(row):
        section = {"schedule": "zb-h1"} if row["search"] else row["candidate"].section()  # zb-h1's placement
        out = {"label": row["candidate"].label, "section": section, "search": row["search"],
               "makespan": row["makespan"], "memory": row["memory"], "all_to_all": row["all_to_all"]}
        return {**out, **knobs.entry(row["recompute"], rows)} if knobs else out
    verdict = {"overlap": overlap_verdict(rows, costs, budget)} if overlap else {}
    return {"choice": entry(rows[0]), "runner_up": entry(rows[1]) if len(rows) > 1 else None, **verdict,
            "budget": budget, "costs": {"tf": costs.tf, "tb": costs.tb, "tw": costs.tw, "embed": list(costs.embed),
                                        "head": list(costs.head), "p2p": measured.p2p,
                                        "op_overhead": list(costs.op_overhead), "op_sizes": list(measured.op_sizes),
                                        "op_residual": measured.op_residual, "head_memory": head_memory,
                                        "vocab_parallel": vocab_parallel, "vocab": list(measured.vocab),
                                        "layers": [list(t) for t in costs.layers],
                                        "moe_layers": [f for k in measured.layer_kinds for f in k],
                                        "all_to_all": [list(t) for t in costs.all_to_all]}}


def describe(decision: dict) -> str:
    c, r = decision["choice"], decision["runner_up"]
    k = decision["costs"]
    vocab = " with vocabulary parallelism" if k.get("vocab_parallel") else ""
    logits = f", a micro-batch's logits {k['head_memory']:.3g} of it" if k.get("head_memory") else ""
    line = (f"auto schedule: {c['label']}{vocab} (simulated makespan {c['makespan'] * 1e3:.1f} ms, peak memory "
            f"{c['memory']:g} of budget {decision['budget']:g}{logits})")
    under = f" under recompute {r['recompute_label']}" if r and "recompute_label" in r else ""  # auto_recompute
    line += (f"; runner-up {r['label']}{under} ({r['makespan'] * 1e3:.1f} ms, memory {r['memory']:g})" if r
             else "; no runner-up fits")
    return line + (f"; measured per 1F1B stage TF={k['tf'] * 1e3:.2f} TB={k['tb'] * 1e3:.2f} "
                   f"TW={k['tw'] * 1e3:.2f} ms, embedding F/B/W={'/'.join(f'{x * 1e3:.2f}' for x in k['embed'])} ms, "
                   f"head + loss F/B/W={'/'.join(f'{x * 1e3:.2f}' for x in k['head'])} ms"
                   + (f" (vocabulary passes per slice EF/S/T/EW={'/'.join(f'{x * 1e3:.2f}' for x in k['vocab'])} ms "
                      "beyond their fixed part)" if k.get("vocab") else "")
                   + moe_costs(k, c)
                   + f", fixed per op F/B/W={'/'.join(f'{x * 1e3:.2f}' for x in k['op_overhead'])} ms "
                   f"(micro-batches timed {' and '.join('whole' if n == 1 else f'in {n} segments' for n in k['op_sizes'])}; "
                   f"{k['op_residual'] * 1e3:.2f} ms of it from the traced makespans), "
                   f"p2p {k['p2p'] * 1e3:.3f} ms") + recompute_why(c) + overlap_why(decision)


def moe_costs(costs: dict, choice: dict) -> str:
    """The log line's part on MoE layers (decide's "costs"; empty for a dense model): a MoE layer's and a dense
    layer's F/B/W, and the all-to-all per MoE layer and its share of the choice's step on its busiest rank."""
    flags, layers, comm = costs.get("moe_layers") or [], costs.get("layers") or [], costs.get("all_to_all") or []
    if not any(flags):
        return ""
    moe, dense = flags.index(1), flags.index(0) if 0 in flags else None
    ms = lambda t: "/".join(f"{x * 1e3:.2f}" for x in t)  # noqa: E731
    text = f", a MoE layer F/B/W={ms(layers[moe])} ms ({sum(flags)} of {len(flags)} layers)"
    text += f", a dense one {ms(layers[dense])} ms" if dense is not None else ""
    if not comm:
        return text + ", no all-to-all (no expert parallelism)"
    share = choice.get("all_to_all", 0.0) / choice["makespan"] if choice["makespan"] > 0 else 0.0
    return text + (f", all-to-all per MoE layer F/B={ms(comm[moe])} ms ({share:.1%} of the chosen step on its "
                   "busiest rank)")


def overlap_why(decision: dict) -> str:
    """The log line's part on overlapped units (decide's "overlap"), empty when they were not weighed."""
    verdict = decision.get("overlap")
    if not verdict:
        return ""
    return f"; overlap of the all-to-all: {'yes' if verdict['overlap'] else 'no'}, {verdict['why']}"


def recompute_why(choice: dict) -> str:
    """The log line's part on the recompute setting "auto" chose (auto_recompute), empty when it chose none."""
    if "recompute" not in choice:
        return ""
    best = choice["recompute_options"]
    text = "; ".join(f"{label}: {b['label']} {b['makespan'] * 1e3:.1f} ms" if b else f"{label}: nothing fits"
                     for label, b in best.items())
    return f"; recompute {choice['recompute_label']}, the fastest that fits (the fastest under each: {text})"


BYTE_UNITS = {"B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30}


def parse_bytes(text: str) -> int | None:
    """"24GiB", "1.5 GB", "4096B" -> bytes; None when `text` is no such string."""
    t = text.strip().upper().replace(" ", "")
    for unit in sorted(BYTE_UNITS, key=len, reverse=True):
        if t.endswith(unit):
            try:
                return int(float(t[:-len(unit)]) * BYTE_UNITS[unit])
            except ValueError:
                return None
    return None


def unit_bytes(layers_per_stage: float, seq: int, mbs: int, hidden: int, heads: int, dtype_bytes: int,
               context_parallel: int = 1) -> float:
    """Bytes of one memory unit (one micro-batch's activations on one 1F1B stage): per layer
    s*b*h*(34 + 5*a*s/h) bytes at 2-byte precision, Korthikanti et al. 2022 ("Reducing activation
    recomputation in large transformer models", eq. 1, no tensor/sequence parallelism), scaled by
    the dtype's size. An estimate: it ignores the embedding's and the head's own activations. Under
    context parallelism a rank holds s / C tokens, whose queries score all s keys: (s/C)*b*h*(34 + 5*a*s/h)."""
    per_layer = seq / context_parallel * mbs * hidden * (34 + 5 * heads * seq / hidden) * dtype_bytes / 2
    return per_layer * layers_per_stage


LOGIT_BYTES = 4  # the loss holds the logits in fp32 (gpt_loss; a slice's softmax under vocabulary parallelism)


def logits_units(seq: int, mbs: int, vocab: int, unit: float, context_parallel: int = 1) -> float:
    """One micro-batch's logits (mbs x seq x vocab, fp32), which the loss stage holds from its forward to
    the end of its backward (each rank's slice of them from its S to its T under vocabulary
    parallelism), in memory units of `unit` bytes (`unit_bytes`); a context-parallel rank's of its s / C tokens."""
    return seq / context_parallel * mbs * vocab * LOGIT_BYTES / unit
