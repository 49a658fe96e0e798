"""Every catalogued generator, over a grid of settings, yields a valid schedule that the
simulator runs; a setting is refused only by its catalogue check, and a pinned set of
settings must build."""
import pytest

from megatron_ds.schedules import CATALOG, Schedule, ScheduleError, build_schedule, simulate
from megatron_ds.schedules.catalog import ANY, OPTIONAL

BUILTIN = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zbv", "bitpipe", "seq1f1b")


def settings():
    for name, spec in CATALOG.items():
        for p in (1, 2, 3, 4, 6, 8):
            for m in (1, 2, p, 2 * p, 3 * p):
                yield name, p, m, {}
        if spec.virtual_stages == ANY:
            for p, m, v in [(2, 4, 2), (4, 8, 3), (4, 4, 4)]:
                yield name, p, m, {"virtual_stages": v}
        if spec.seq_splits:
            for p, m, k, v, split in [(4, 3, 3, 1, False), (4, 4, 2, 2, True), (3, 5, 4, 1, True),
                                      (2, 2, 2, 2, False)]:
                kw = {"seq_splits": k, "split_backward": split and spec.split_backward == OPTIONAL}
                if spec.virtual_stages == ANY:
                    kw["virtual_stages"] = v
                yield name, p, m, kw


def _refused_by_check(name, p, m, kwargs):
    check = CATALOG[name].check
    try:
        if check:
            check(p, m, kwargs.get("virtual_stages", 1), kwargs.get("seq_splits", 1))
    except ScheduleError:
        return True
    return False


@pytest.mark.parametrize("name, p, m, kwargs", list(settings()))
def test_valid_or_refused_by_its_check(name, p, m, kwargs):
    refused = _refused_by_check(name, p, m, kwargs)
    try:
        s = build_schedule(name, p, m, **kwargs)
    except ScheduleError as exc:
        assert refused, f"{name} p={p} m={m} {kwargs}: the generator refused what the check let through: {exc}"
        assert name in str(exc) and "=" in str(exc), str(exc)
        return
    assert not refused
    k = s.seq_splits
    units = sum(s.stages * k for _ in range(m))
    # A unit runs F+BW or F+B+W; DualPipeV splits only some backwards.
    assert 2 * units <= sum(len(ops) for ops in s.ranks) <= 3 * units
    res = simulate(s, 1.0, 1.5, 0.5)
    assert res.makespan >= max(res.busy)
    assert Schedule.from_json(s.to_json()) == s


@pytest.mark.parametrize("name", list(CATALOG))
def test_every_schedule_builds_for_an_even_pipeline_and_m_a_multiple_of_2p(name):
    for p in (2, 4, 8):
        for m in (2 * p, 4 * p):
            assert build_schedule(name, p, m).micro_batches == m


def test_refusals_of_the_builtin_schedules_are_pinned():
    refused = {}
    for name, p, m, kwargs in settings():
        if name in BUILTIN and _refused_by_check(name, p, m, kwargs):
            refused[name] = refused.get(name, 0) + 1
    # Only bitpipe refuses grid points (odd p); every other must build, for any m.
    assert refused == {"bitpipe": 10}


