"""Every schedule on ScheduleEngine equals the single-process reference: loss, every
parameter's gradient (first step) and the weights after 3 optimizer steps."""
import pytest

from tests.gpt_harness import assert_matches_reference, engine_rank_run, reference_run, tiny_config
from tests.multiproc import run_ranks

STEPS = 3


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1", "zbv"])
def test_pp2(schedule):
    gas, layers = 4, 4
    ref = reference_run(tiny_config(layers), 1, gas, STEPS)
    results = run_ranks(2, engine_rank_run, 2, gas, STEPS, {"schedule": schedule}, 1, 0.0, False, layers)
    assert_matches_reference(results, ref)
