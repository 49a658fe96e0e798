"""Every ready config in ds_configs/ is valid and its schedule builds for a 4-stage pipeline (auto: its
budget fits one, which it starts on)."""
import json
import pathlib

import pytest

from megatron_ds.gpt_config import GPTConfig
from megatron_ds.pipe.plan.config import pipeline_settings
from megatron_ds.pipe.plan.plan import make_plan
from megatron_ds.schedules import CATALOG

CONFIGS = sorted((pathlib.Path(__file__).parents[3] / "ds_configs").glob("*.json"))


def test_a_config_per_engine_schedule():
    names = {pipeline_settings(json.loads(p.read_text())).schedule for p in CONFIGS}
    assert {"deepspeed", "auto", *CATALOG} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_is_valid(path):
    cfg = json.loads(path.read_text())
    settings = pipeline_settings(cfg)
    if settings.auto:  # its budget fits a schedule of a GPT's 4-stage pipeline, which it starts on
        batch = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 8}
        plan, start = make_plan(GPTConfig(vocab_size=50304, hidden_size=1024, num_layers=8, num_attention_heads=16,
                                          max_position_embeddings=2048), {**cfg, **batch}, 4, 1)
        assert plan.schedule.name in CATALOG and plan.schedule.pp == 4 and start.budget > 0
    elif not settings.stock:
        sched = settings.build_schedule(4, 8)  # validates, or raises
        assert (sched.name, sched.pp) == (settings.schedule, 4)
