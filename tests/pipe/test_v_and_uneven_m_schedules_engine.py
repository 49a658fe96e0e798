"""The schedules added beyond the peers (zbv-half, zbv-min, dualpipev, interleaved and bitpipe
with micro-batch counts that are not multiples of pp) on ScheduleEngine equal the
single-process reference: loss, every gradient (first step) and the weights after 3
optimizer steps, 1e-5, at PP=2, PP=4 and PP=2 x DP=2 with ZeRO-1 (fp32). DualPipeV needs
m >= 2p, the flexible interleaved/bitpipe cases need m not a multiple of p: they get their
own launch where one gas cannot serve both."""
import pytest

from tests.gpt_harness import assert_schedules_match_reference

STEPS = 3
# the V orders built for other costs (op_costs) are other orders: they run exactly too
V_SCHEDULES = [{"schedule": "zbv-half"}, {"schedule": "zbv-min"},
               {"schedule": "zbv-half", "op_costs": [1, 1.5, 0.5]}, {"schedule": "zbv-min", "op_costs": [3, 4, 2]}]
FLEXIBLE = [{"schedule": "interleaved", "virtual_stages": 2}, {"schedule": "bitpipe"}]
DUALPIPEV = [{"schedule": "dualpipev"}]


@pytest.mark.parametrize("world,pp,gas,layers,pipelines", [
    (2, 2, 3, 4, V_SCHEDULES + FLEXIBLE),
    (2, 2, 4, 4, DUALPIPEV),
    (4, 4, 10, 8, V_SCHEDULES + FLEXIBLE + DUALPIPEV),
    (4, 2, 3, 4, V_SCHEDULES + FLEXIBLE),
    (4, 2, 4, 4, DUALPIPEV),
], ids=["pp2-m3", "pp2-dualpipev", "pp4-m10", "pp2xdp2-m3", "pp2xdp2-dualpipev"])
def test_v_dualpipev_and_uneven_m_schedules_match_reference(world, pp, gas, layers, pipelines):
    assert_schedules_match_reference(world, pp, gas, layers, pipelines, STEPS, timeout=900)
