"""Every schedule on ScheduleEngine equals the single-process reference: loss, every
parameter's gradient (first step, 1e-5) and the weights after 3 optimizer steps (1e-5),
at PP=2, PP=4 and PP=2 x DP=2 with ZeRO-1 (fp32)."""
import pytest

from tests.gpt_harness import assert_matches_reference, engine_rank_runs, reference_run, tiny_config
from megatron_ds.testing.launcher import run_ranks

STEPS = 3
SCHEDULES = [{"schedule": "1f1b"}, {"schedule": "gpipe"}, {"schedule": "interleaved", "virtual_stages": 2},
             {"schedule": "zb-h1"}, {"schedule": "zb-h2"}, {"schedule": "zbv"}]


@pytest.mark.parametrize("world,pp,gas,layers", [(2, 2, 4, 4), (4, 4, 8, 8), (4, 2, 4, 4)],
                         ids=["pp2", "pp4", "pp2xdp2"])
def test_every_schedule_matches_reference(world, pp, gas, layers):
    ref = reference_run(tiny_config(layers), world // pp, gas, STEPS)
    per_rank = run_ranks(world, engine_rank_runs, pp, gas, STEPS, SCHEDULES, num_layers=layers, timeout=600)
    for i, pipeline in enumerate(SCHEDULES):
        try:
            assert_matches_reference([r[i] for r in per_rank], ref)
        except AssertionError as exc:
            raise AssertionError(f"{pipeline}: {exc}") from None
