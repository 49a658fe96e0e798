"""Every generator, over a grid of settings, yields a valid schedule that the simulator runs."""
import pytest

from megatron_ds.schedules import SCHEDULE_NAMES, Schedule, ScheduleError, build_schedule, simulate


def settings():
    for name in SCHEDULE_NAMES:
        for p in (1, 2, 3, 4, 6, 8):
            for m in (1, 2, p, 2 * p, 3 * p):
                yield name, p, m, {}
        if name in ("interleaved", "seq1f1b"):
            for p, m, v in [(2, 4, 2), (4, 8, 3), (4, 4, 4)]:
                yield name, p, m, {"virtual_stages": v}
        if name == "seq1f1b":
            for p, m, k, v, split in [(4, 3, 3, 1, False), (4, 4, 2, 2, True), (3, 5, 4, 1, True),
                                      (2, 2, 2, 2, False)]:
                yield name, p, m, {"seq_splits": k, "virtual_stages": v, "split_backward": split}


@pytest.mark.parametrize("name, p, m, kwargs", list(settings()))
def test_valid_or_refused(name, p, m, kwargs):
    try:
        s = build_schedule(name, p, m, **kwargs)
    except ScheduleError as exc:
        # Refusals must name the schedule or the setting.
        assert name in str(exc) or "=" in str(exc)
        return
    k = s.seq_splits
    units = sum(s.stages * k for _ in range(m))
    assert sum(len(ops) for ops in s.ranks) in (2 * units, 3 * units)
    res = simulate(s, 1.0, 1.5, 0.5)
    assert res.makespan >= max(res.busy)
    assert Schedule.from_json(s.to_json()) == s
