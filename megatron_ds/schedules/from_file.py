"""A schedule designed elsewhere (an ILP, a hand edit of an export): op lists read from a file in
the JSON export format of DESIGN.md, proven runnable before any process group starts.

ds_config `"pipeline": {"schedule": "file:PATH.json"}` names one. The file fixes everything a
generator's knobs would (pp, micro-batches, chunks and their placement, segments); the run's
flags must agree with it, since nothing can re-plan a written order for another shape. A file's "overlap"
(overlapped forward-and-backward units, SCHEDULES.md) is validated with the rest; an executor that does not
overlap them runs its two ops one after the other, the same schedule.
"""
from __future__ import annotations

from .ir import Schedule, ScheduleError
from .simulate import simulate
from .validate import validate

PREFIX = "file:"


def load(path: str) -> Schedule:
    """The schedule in `path`, validated (the validator's message when it breaks a rule) and simulated."""
    try:
        with open(path) as fh:
            text = fh.read()
    except OSError as exc:
        raise ScheduleError(f"cannot read it: {exc.strerror}") from None
    try:
        schedule = Schedule.from_json(text)
    except ScheduleError:
        raise
    except (TypeError, ValueError, AttributeError) as exc:  # a field of the wrong JSON type
        raise ScheduleError(f"not a schedule in the JSON export format (docs/DESIGN.md): {exc}") from None
    lengths = schedule.segment_lengths
    if lengths is not None and (len(lengths) != schedule.seq_splits or min(lengths) < 1):
        raise ScheduleError(f"segment_lengths {lengths} must hold seq_splits={schedule.seq_splits} positive "
                            "token counts, one per segment")
    validate(schedule)
    simulate(schedule)  # a runnable order has a timeline; the run draws and traces against it
    return schedule


def for_run(path: str, pp: int, micro_batches: int, segment_lengths=None) -> Schedule:
    """The file's schedule, when it was written for this pipeline size and micro-batch count."""
    schedule = load(path)
    if schedule.pp != pp:
        raise ScheduleError(f"{PREFIX}{path} holds op lists for pp={schedule.pp} ranks; this run has "
                            f"--pipeline-model-parallel-size {pp}")
    if schedule.micro_batches != micro_batches:
        raise ScheduleError(f"{PREFIX}{path} runs micro_batches={schedule.micro_batches}; this step has "
                            f"{micro_batches} (a written order runs one micro-batch count only)")
    if segment_lengths is not None and schedule.segment_lengths not in (None, list(segment_lengths)):
        raise ScheduleError(f"{PREFIX}{path} cuts sequences into segment_lengths {schedule.segment_lengths}, "
                            f"the run into {list(segment_lengths)}")
    return schedule
