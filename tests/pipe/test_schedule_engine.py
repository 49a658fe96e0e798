"""Every schedule on ScheduleEngine equals the single-process reference: loss, every
parameter's gradient (first step, 1e-5) and the weights after 3 optimizer steps (1e-5),
at PP=2, PP=4 and PP=2 x DP=2 with ZeRO-1 (fp32)."""
import pytest

from tests.gpt_harness import assert_schedules_match_reference

STEPS = 3
SCHEDULES = [{"schedule": "1f1b"}, {"schedule": "gpipe"}, {"schedule": "interleaved", "virtual_stages": 2},
             {"schedule": "zb-h1"}, {"schedule": "zb-h2"}, {"schedule": "zbv"}]


@pytest.mark.parametrize("world,pp,gas,layers", [(2, 2, 4, 4), (4, 4, 8, 8), (4, 2, 4, 4)],
                         ids=["pp2", "pp4", "pp2xdp2"])
def test_every_schedule_matches_reference(world, pp, gas, layers):
    assert_schedules_match_reference(world, pp, gas, layers, SCHEDULES, STEPS, timeout=600)
