"""Every ready config in ds_configs/ is valid and its schedule builds for a 4-stage pipeline."""
import json
import pathlib

import pytest

from megatron_ds.pipe.config import pipeline_settings
from megatron_ds.schedules import CATALOG

CONFIGS = sorted((pathlib.Path(__file__).parents[2] / "ds_configs").glob("*.json"))


def test_a_config_per_engine_schedule():
    names = {pipeline_settings(json.loads(p.read_text())).schedule for p in CONFIGS}
    assert {"deepspeed", *CATALOG} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_is_valid(path):
    cfg = json.loads(path.read_text())
    settings = pipeline_settings(cfg)
    if not settings.stock:
        sched = settings.build_schedule(4, 8)  # validates, or raises
        assert (sched.name, sched.pp) == (settings.schedule, 4)
