"""The schedule catalogue: everything the package knows about each schedule, in one entry.

A `ScheduleSpec` names a generator and the knobs it takes. A knob a schedule does not take,
or whose value the schedule fixes itself (ZB-V and BitPipe always hold 2 chunks per rank,
the zero-bubble schedules always split the backward), is refused when set, so a ds_config
that asks for something the schedule would ignore fails at start-up. Adding a schedule is a
generator module plus one entry in CATALOG: the ds_config check, the CLI, the comparison
table and the benchmarks all read their lists from here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

from .generators import basic, bitpipe, dualpipev, interleaved, seq1f1b, vocab, vshape, zbv, zero_bubble
from .ir import Schedule, ScheduleError
from .validate import validate

ANY = "any"                        # virtual_stages: the user picks the chunk count
NEVER, OPTIONAL, ALWAYS = "never", "optional", "always"   # split_backward policies
BASELINE = "1f1b"                  # what the comparison table measures speed-ups against

Check = Callable[[int, int, int, int], None]   # check(pp, m, v, k) raises ScheduleError
# The knobs a schedule may take (ScheduleSpec.knobs), with the value that means "not set"; the ds_config
# "pipeline" keys of the same names are checked against them.
KNOBS = {"virtual_stages": 1, "seq_splits": 1, "split_backward": False, "op_costs": None}


@dataclass(frozen=True)
class ScheduleSpec:
    """One schedule: its generator and the knobs it understands.

    `generate(pp, m, **knobs)` receives only the knobs the spec takes (virtual_stages when it
    is ANY, seq_splits when `seq_splits`, split_backward when OPTIONAL). `check(pp, m, v, k)`
    refuses settings the schedule cannot run, with a message naming the key, value and rule.
    `virtual_stages` is None (one chunk per rank), a fixed count, or ANY.
    """
    name: str
    generate: Callable[..., Schedule]
    virtual_stages: Union[None, int, str] = None
    seq_splits: bool = False
    split_backward: str = NEVER
    check: Optional[Check] = None
    op_costs: bool = False  # the op order is built for the layer's TF, TB, TW (default: equal)
    # vocab_parallel: None (cannot carry the vocabulary passes) or the schedule's other orders the
    # passes may be placed in (generators/vocab.py weighs them against its own order)
    vocab_orders: Optional[Callable[..., list]] = lambda pp, m, **knobs: []
    # overlap: None, or the generator (same knobs) of the order whose forwards and backwards of
    # other micro-batches run as overlapped units (Schedule.overlap), each one's all-to-all behind the other
    overlapped: Optional[Callable[..., Schedule]] = None

    def knobs(self, segment_lengths=None, **given) -> dict:
        """The generator's keyword arguments from the KNOBS `given` (the others unset); refuses a knob this
        schedule does not take, and one that is not a knob.
        `segment_lengths` (tokens per segment) go with seq_splits: Seq1F1B caps its order by them."""
        unknown = [key for key in given if key not in KNOBS]
        if unknown:
            raise ScheduleError(f"{self.name}: {', '.join(unknown)} is not a schedule knob "
                                f"(they are {', '.join(KNOBS)})")
        given = {**KNOBS, **given}
        virtual_stages, seq_splits = given["virtual_stages"], given["seq_splits"]
        split_backward, op_costs = given["split_backward"], given["op_costs"]
        out = {}
        if self.virtual_stages == ANY:
            out["virtual_stages"] = virtual_stages
        elif virtual_stages != 1:
            fixed = (f"{self.name} always places {self.virtual_stages} chunks per rank"
                     if self.virtual_stages else f"{self.name} places one chunk per rank")
            raise ScheduleError(f"{self.name} does not take virtual_stages={virtual_stages}: {fixed}; "
                                f"virtual stages apply to {', '.join(takes('virtual_stages'))}")
        if self.seq_splits:
            out["seq_splits"] = seq_splits
            if segment_lengths is not None:
                out["segment_lengths"] = list(segment_lengths)
        elif segment_lengths is not None:
            raise ScheduleError(f"{self.name} does not take segment_lengths: it does not split the sequence")
        elif seq_splits != 1:
            raise ScheduleError(f"{self.name} does not take seq_splits={seq_splits}: sequence "
                                f"splitting needs schedule {' or '.join(takes('seq_splits'))}")
        if self.split_backward == OPTIONAL:
            out["split_backward"] = split_backward
        elif split_backward:
            why = ("always splits the backward into B and W" if self.split_backward == ALWAYS
                   else "runs the fused backward")
            raise ScheduleError(f"{self.name} does not take split_backward=True: it {why}; the "
                                f"choice applies to {', '.join(takes('split_backward'))}")
        if op_costs is not None:
            if not self.op_costs:
                raise ScheduleError(f"{self.name} does not take op_costs: its op order is the same for any costs; "
                                    f"op_costs apply to {', '.join(takes('op_costs'))}")
            out["op_costs"] = _checked_op_costs(op_costs)
        return out

    def variants(self, virtual_stages: int = 2, seq_splits=(2,), split: bool = True,
                 op_costs=None) -> list[tuple[str, dict]]:
        """(note, knobs) settings worth showing side by side: the knob the schedule is about
        (its sequence splits, else its chunk count) and, with `split`, the B/W split too; beside
        them the order built for `op_costs` (TF, TB, TW, when unequal) where the schedule takes them."""
        if self.seq_splits:
            rows = [(f"k={k}", {"seq_splits": k}) for k in seq_splits]
        elif self.virtual_stages == ANY:
            rows = [(f"v={virtual_stages}", {"virtual_stages": virtual_stages})]
        else:
            rows = [("", {})]
        if split and self.split_backward == OPTIONAL:
            rows += [(f"{note} B/W".strip(), {**kw, "split_backward": True}) for note, kw in rows]
        if self.op_costs and op_costs is not None and len(set(op_costs)) > 1:
            rows += [("costed", {"op_costs": tuple(op_costs)})]
        return rows


def _checked_op_costs(op_costs) -> tuple:
    if not (isinstance(op_costs, (list, tuple)) and len(op_costs) == 3 and all(
            isinstance(c, (int, float)) and not isinstance(c, bool) and c > 0 for c in op_costs)):
        raise ScheduleError(f"op_costs={op_costs!r}: give [TF, TB, TW], three positive times of a layer's forward, "
                            "input-gradient and weight-gradient passes (python -m bench.layer_costs measures them)")
    return tuple(op_costs)


def _interleaved(pp: int, m: int, virtual_stages: int) -> Schedule:
    if virtual_stages == 1:  # one chunk per rank is plain 1F1B, as in Megatron
        return basic.one_f_one_b_schedule(pp, m, name="interleaved")
    return interleaved.interleaved(pp, m, virtual_stages)


def _interleaved_overlapped(pp: int, m: int, virtual_stages: int) -> Schedule:
    if virtual_stages == 1:
        return basic.one_f_one_b_overlapped(pp, m, name="interleaved")
    return interleaved.interleaved_overlapped(pp, m, virtual_stages)


def _check_interleaved(pp, m, v, k):
    if v > 1:
        interleaved.check_rounds(pp, m, v)


def _check_seq1f1b(pp, m, v, k):
    if v > 1:
        interleaved.check(pp, m * k, v, "seq1f1b", what="micro_batches*seq_splits")


CATALOG: dict[str, ScheduleSpec] = {spec.name: spec for spec in (
    ScheduleSpec("gpipe", basic.gpipe),
    ScheduleSpec("1f1b", basic.one_f_one_b_schedule, overlapped=basic.one_f_one_b_overlapped),
    ScheduleSpec("interleaved", _interleaved, virtual_stages=ANY, check=_check_interleaved,
                 overlapped=_interleaved_overlapped),
    ScheduleSpec("zb-h1", zero_bubble.zb_h1, split_backward=ALWAYS),
    ScheduleSpec("zb-h2", zero_bubble.zb_h2, split_backward=ALWAYS),
    ScheduleSpec("zbv", zbv.zbv, virtual_stages=2, split_backward=ALWAYS),
    ScheduleSpec("bitpipe", bitpipe.bitpipe, virtual_stages=2,
                 check=lambda pp, m, v, k: bitpipe.check(pp, m)),
    ScheduleSpec("seq1f1b", seq1f1b.seq1f1b, virtual_stages=ANY, seq_splits=True,
                 split_backward=OPTIONAL, check=_check_seq1f1b),
    # ZB-V under the controllable-memory paper's limits: V-Half and V-Min.
    ScheduleSpec("zbv-half", lambda pp, m, op_costs=None: vshape.zbv_memory(pp, m, "half", op_costs),
                 virtual_stages=2, split_backward=ALWAYS, op_costs=True,
                 vocab_orders=lambda pp, m, op_costs=None: vshape.roomier_orders(pp, m, "half", op_costs)),
    ScheduleSpec("zbv-min", lambda pp, m, op_costs=None: vshape.zbv_memory(pp, m, "min", op_costs),
                 virtual_stages=2, split_backward=ALWAYS, op_costs=True,
                 vocab_orders=lambda pp, m, op_costs=None: vshape.roomier_orders(pp, m, "min", op_costs)),
    ScheduleSpec("dualpipev", dualpipev.dualpipev, virtual_stages=2, split_backward=ALWAYS,
                 overlapped=lambda pp, m: dualpipev.dualpipev(pp, m, overlap=True)),
)}


# Whether a spec takes each knob of KNOBS, and vocab_parallel, as a choice (takes; a test holds the keys to KNOBS)
TAKES: dict[str, Callable[[ScheduleSpec], bool]] = {
    "virtual_stages": lambda s: s.virtual_stages == ANY,
    "seq_splits": lambda s: s.seq_splits,
    "split_backward": lambda s: s.split_backward == OPTIONAL,
    "op_costs": lambda s: s.op_costs,
    "vocab_parallel": lambda s: s.vocab_orders is not None,
    "overlap": lambda s: s.overlapped is not None,
}


def takes(knob: str) -> list[str]:
    """Names of the schedules for which `knob` is a choice; ValueError for a name that is no knob."""
    if knob not in TAKES:
        raise ValueError(f"{knob!r} is not a schedule knob (they are {', '.join(TAKES)})")
    return [s.name for s in CATALOG.values() if TAKES[knob](s)]


def lookup(name: str) -> ScheduleSpec:
    if name not in CATALOG:
        raise ScheduleError(f"unknown schedule {name!r} (schedule={name}): "
                            f"choose one of {', '.join(CATALOG)}")
    return CATALOG[name]


def build_schedule(name: str, pp: int, micro_batches: int, *, segment_lengths=None, vocab_parallel: bool = False,
                   overlap: bool = False, **given) -> Schedule:
    """Look the schedule up, check the settings (`given`: KNOBS, the others unset), generate the per-rank op
    lists (with the vocabulary passes placed on every rank when `vocab_parallel`; the overlapped order, whose
    units Schedule.overlap names, when `overlap`), validate them."""
    spec = lookup(name)
    virtual_stages = given.get("virtual_stages", KNOBS["virtual_stages"])
    seq_splits = given.get("seq_splits", KNOBS["seq_splits"])
    for key, val in (("pp", pp), ("micro_batches", micro_batches), ("virtual_stages", virtual_stages),
                     ("seq_splits", seq_splits)):
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise ScheduleError(f"{name} needs a positive integer {key} ({key}={val!r})")
    knobs = spec.knobs(segment_lengths, **given)
    check_vocab_parallel(spec, vocab_parallel)
    check_overlap(spec, overlap, vocab_parallel)
    if spec.check:
        spec.check(pp, micro_batches, virtual_stages, seq_splits)
    schedule = (spec.overlapped if overlap else spec.generate)(pp, micro_batches, **knobs)
    if vocab_parallel:
        others = spec.vocab_orders(pp, micro_batches, **{k: v for k, v in knobs.items() if k == "op_costs"})
        schedule = vocab.add_vocab_passes(schedule, others=others)
    validate(schedule)
    return schedule


def check_vocab_parallel(spec: ScheduleSpec, vocab_parallel) -> None:
    if not isinstance(vocab_parallel, bool):
        raise ScheduleError(f"vocab_parallel={vocab_parallel!r}: must be true or false")
    if vocab_parallel and spec.vocab_orders is None:
        raise ScheduleError(f"{spec.name} does not take vocab_parallel=True: {spec.name} cannot carry the "
                            f"vocabulary passes; vocabulary parallelism applies to {', '.join(takes('vocab_parallel'))}")


def check_overlap(spec: ScheduleSpec, overlap, vocab_parallel: bool = False) -> None:
    if not isinstance(overlap, bool):
        raise ScheduleError(f"overlap={overlap!r}: must be true or false")
    if overlap and spec.overlapped is None:
        raise ScheduleError(f"{spec.name} does not take overlap=True: it has no overlapped order; overlapped "
                            f"forward-and-backward units apply to {', '.join(takes('overlap'))}")
    if overlap and vocab_parallel:
        raise ScheduleError(f"{spec.name} does not take overlap=True with vocab_parallel=True: the vocabulary "
                            "passes are not placed around overlapped units yet")
