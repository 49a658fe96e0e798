"""Adding a schedule is a generator and one catalogue entry: a test-local schedule, never
seen by the engine before, trains on ScheduleEngine exactly as the single-process reference."""
import pytest

from megatron_ds.pipe.config import ConfigError, pipeline_settings
from megatron_ds.schedules import CATALOG, Op, Schedule, ScheduleError, ScheduleSpec
from megatron_ds.schedules import placement
from megatron_ds.schedules.catalog import ANY
from megatron_ds.testing.launcher import run_ranks
from tests.gpt_harness import assert_matches_reference, engine_rank_run, reference_run, tiny_config


def serial(pp, m, virtual_stages):
    """One micro-batch at a time: its forward through every chunk, then its backward."""
    stages = pp * virtual_stages
    ranks = [[] for _ in range(pp)]
    for mb in range(m):
        for r in range(pp):
            mine = range(r, stages, pp)
            ranks[r] += [Op("F", 0, s, mb) for s in mine] + [Op("BW", 0, s, mb) for s in reversed(mine)]
    return Schedule("serial", pp, m, 1, stages, 1, placement.interleaved(pp, virtual_stages), ranks)


def _even_micro_batches(pp, m, v, k):
    if m % 2:
        raise ScheduleError(f"serial needs an even number of micro-batches (micro_batches={m})")


SERIAL = ScheduleSpec("serial", serial, virtual_stages=ANY, check=_even_micro_batches)


@pytest.fixture
def catalogued(monkeypatch):
    monkeypatch.setitem(CATALOG, SERIAL.name, SERIAL)


def test_the_entry_is_checked_like_any_schedule(catalogued):
    settings = pipeline_settings({"pipeline": {"schedule": "serial", "virtual_stages": 2}})
    assert settings.build_schedule(2, 4).stages == 4
    with pytest.raises(ScheduleError, match=r"micro_batches=3"):
        settings.build_schedule(2, 3)
    with pytest.raises(ConfigError, match="serial does not take seq_splits=2"):
        pipeline_settings({"pipeline": {"schedule": "serial", "seq_splits": 2}})


def _train_serial(*args, **kw):
    CATALOG[SERIAL.name] = SERIAL  # this rank's process registers the entry, as a package module would
    return engine_rank_run(*args, **kw)


def test_a_new_catalogue_entry_trains_like_the_reference():
    steps, gas = 3, 4
    ref = reference_run(tiny_config(4), 1, gas, steps)
    results = run_ranks(2, _train_serial, 2, gas, steps, {"schedule": "serial", "virtual_stages": 2},
                        num_layers=4, timeout=600)
    assert_matches_reference(results, ref)
    assert [r["engine"]["chunks"] for r in results] == [[(0, 0), (0, 2)], [(0, 1), (0, 3)]]
