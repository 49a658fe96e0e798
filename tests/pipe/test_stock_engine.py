"""DeepSpeed's stock PipelineEngine (TrainSchedule) on our GPT equals the single-process reference."""
import pytest

from tests.gpt_harness import assert_matches_reference, engine_rank_run, reference_run, tiny_config
from megatron_ds.testing.launcher import run_ranks

STEPS, GAS = 3, 4


@pytest.mark.parametrize("world,pp", [(2, 2), (4, 4), (4, 2)], ids=["pp2", "pp4", "pp2xdp2"])
def test_stock_1f1b_matches_reference(world, pp):
    dp = world // pp
    ref = reference_run(tiny_config(), dp, GAS, STEPS)
    results = run_ranks(world, engine_rank_run, pp, GAS, STEPS)
    assert_matches_reference(results, ref)
