"""The schedule knobs have one list, catalog.KNOBS: the specs, build_schedule, takes() and the ds_config's
settings read it, and a name that is no knob is refused rather than read as another."""
import dataclasses

import pytest

from megatron_ds.pipe.plan.config import PipelineSettings, pipeline_settings
from megatron_ds.schedules import CATALOG, ScheduleError, build_schedule
from megatron_ds.schedules.catalog import KNOBS, TAKES, takes


def test_takes_has_a_rule_for_every_knob_and_refuses_a_name_that_is_none():
    assert set(TAKES) == {*KNOBS, "vocab_parallel", "overlap"}
    assert takes("split_backward") == ["seq1f1b"]
    assert "interleaved" in takes("virtual_stages") and "zbv-half" in takes("op_costs")
    with pytest.raises(ValueError, match="'virtual_stage' is not a schedule knob"):
        takes("virtual_stage")


def test_a_spec_and_build_schedule_refuse_a_name_that_is_no_knob():
    with pytest.raises(ScheduleError, match="seq_split is not a schedule knob"):
        CATALOG["seq1f1b"].knobs(seq_split=2)
    with pytest.raises(ScheduleError, match="split_bw is not a schedule knob"):
        build_schedule("1f1b", 2, 2, split_bw=True)


def test_unset_knobs_are_the_catalogues_and_the_settings_pass_them_all():
    fields = {f.name: f.default for f in dataclasses.fields(PipelineSettings)}
    assert {key: fields[key] for key in KNOBS} == KNOBS
    settings = pipeline_settings({"pipeline": {"schedule": "seq1f1b", "seq_splits": 2, "split_backward": True}})
    assert settings.knobs() == {**KNOBS, "seq_splits": 2, "split_backward": True}
    assert settings.build_schedule(2, 4) == build_schedule("seq1f1b", 2, 4, seq_splits=2, split_backward=True)
    assert CATALOG["seq1f1b"].knobs() == {"virtual_stages": 1, "seq_splits": 1, "split_backward": False}
