"""build_schedule: checks the settings, calls the generator, validates the result."""
from __future__ import annotations

from typing import Sequence

from .ir import Schedule, ScheduleError
from .validate import validate

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zbv", "bitpipe", "seq1f1b")

# Which knobs each schedule understands; anything else set is refused rather than ignored,
# so a ds_config that asks for something the schedule cannot do fails at start-up.
_TAKES_VIRTUAL = {"interleaved", "seq1f1b"}
_FIXED_VIRTUAL = {"zbv": 2, "bitpipe": 2}
_TAKES_SEQ = {"seq1f1b"}
_ALWAYS_SPLIT = {"zb-h1", "zb-h2", "zbv"}
_TAKES_SPLIT = {"seq1f1b"} | _ALWAYS_SPLIT


def build_schedule(name: str, pp: int, micro_batches: int, *, virtual_stages: int = 1,
                   seq_splits: int = 1, split_backward: bool = False,
                   seq_costs: Sequence[float] | None = None) -> Schedule:
    _check_common(name, pp, micro_batches, virtual_stages, seq_splits, split_backward, seq_costs)
    schedule = _generate(name, pp, micro_batches, virtual_stages, seq_splits, split_backward,
                         seq_costs)
    validate(schedule)
    return schedule


def _check_common(name, pp, m, v, k, split, seq_costs) -> None:
    if name not in SCHEDULE_NAMES:
        raise ScheduleError(f"unknown schedule {name!r} (schedule={name}): "
                            f"choose one of {', '.join(SCHEDULE_NAMES)}")
    for key, val in (("pp", pp), ("micro_batches", m), ("virtual_stages", v), ("seq_splits", k)):
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise ScheduleError(f"{name} needs a positive integer {key} ({key}={val!r})")
    if v != 1 and name not in _TAKES_VIRTUAL:
        if _FIXED_VIRTUAL.get(name) != v:
            fixed = _FIXED_VIRTUAL.get(name)
            rule = (f"{name} always uses {fixed} chunks per replica and rank" if fixed
                    else f"virtual stages apply only to {', '.join(sorted(_TAKES_VIRTUAL))}")
            raise ScheduleError(f"{name} does not take virtual_stages={v}: {rule}")
    if k != 1 and name not in _TAKES_SEQ:
        raise ScheduleError(f"{name} does not take seq_splits={k}: sequence splitting needs schedule seq1f1b")
    if split and name not in _TAKES_SPLIT:
        raise ScheduleError(f"{name} does not take split_backward=True: the B/W split applies to "
                            f"{', '.join(sorted(_TAKES_SPLIT))}")
    if seq_costs is not None:
        if name not in _TAKES_SEQ:
            raise ScheduleError(f"{name} does not take seq_costs: segment costs apply to seq1f1b")
        if len(seq_costs) != k or any(c <= 0 for c in seq_costs):
            raise ScheduleError(f"seq_costs must be {k} positive numbers, one per segment "
                                f"(seq_costs={list(seq_costs)}, seq_splits={k})")


def _generate(name, pp, m, v, k, split, seq_costs) -> Schedule:
    # seq_costs is accepted for every seq1f1b variant: the current orders do not depend on
    # segment costs (the balanced split makes them equal), the simulator uses them.
    from .generators import basic, bitpipe, interleaved, seq1f1b, zbv, zero_bubble
    if name == "gpipe":
        return basic.gpipe(pp, m)
    if name == "1f1b":
        return basic.one_f_one_b_schedule(pp, m)
    if name == "interleaved":
        if v == 1:  # one chunk per rank is plain 1F1B, as in Megatron
            return basic.one_f_one_b_schedule(pp, m, name="interleaved")
        interleaved.check(pp, m, v, name)
        return interleaved.interleaved(pp, m, v)
    if name == "zb-h1":
        return zero_bubble.zb_h1(pp, m)
    if name == "zb-h2":
        return zero_bubble.zb_h2(pp, m)
    if name == "zbv":
        return zbv.zbv(pp, m)
    if name == "bitpipe":
        return bitpipe.bitpipe(pp, m)
    return seq1f1b.seq1f1b(pp, m, k, v=v, split_backward=split)
