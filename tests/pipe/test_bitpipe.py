"""BitPipe: two V-shaped replicas in opposite directions equal the single-process reference
(loss, every gradient after replica sync, 3-step weights, eval loss, grad norm), the twin
copies stay bit-identical under clipping, and the second-leg sync starts before the rank's
last backward op ends (eager overlap)."""
import pytest
import torch

from tests.gpt_harness import assert_matches_reference, engine_rank_runs, reference_run, tiny_config
from megatron_ds.testing.launcher import run_ranks

STEPS, CLIP = 3, 0.5
PIPELINES = [{"schedule": "bitpipe"}]


@pytest.mark.parametrize("world,pp,gas,layers", [(2, 2, 4, 4), (4, 4, 8, 8), (4, 2, 4, 4)],
                         ids=["pp2", "pp4", "pp2xdp2"])
def test_bitpipe_matches_reference(world, pp, gas, layers):
    ref = reference_run(tiny_config(layers), world // pp, gas, STEPS, clip=CLIP)
    results = [r[0] for r in run_ranks(world, engine_rank_runs, pp, gas, STEPS, PIPELINES, num_layers=layers,
                                      clip=CLIP, timeout=600)]
    assert_matches_reference(results, ref)
    for r in results:
        assert r["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-5, abs=1e-6)
        assert ref["grad_norms"][0] > CLIP  # clipping was active
    # every layer is held twice (mirror ranks, both replicas), and the copies are bit-identical
    for key in ref["weights"]:
        copies = [r["weights"][key] for r in results if key in r["weights"] and r["dp_rank"] == 0]
        assert len(copies) >= 2, key
        assert all(torch.equal(copies[0], c) for c in copies[1:]), key
    # eager sync: on each rank the second-leg chunks' all-reduce launches before its last backward ends
    for r in results:
        facts = r["engine"]
        second_leg = [t for (rep, stage), t in facts["replica_syncs"] if stage >= pp]
        assert len(second_leg) == 2 and len(facts["replica_syncs"]) == 4
        assert max(second_leg) < facts["last_backward_end"]


@pytest.mark.parametrize("world,pp,gas,layers", [(2, 2, 1, 4), (4, 4, 2, 8)], ids=["pp2-m1", "pp4-m2"])
def test_bitpipe_with_an_idle_replica_matches_reference(world, pp, gas, layers):
    """m <= p/2 sends every micro-batch down: the up replica's chunks run nothing, and their twin
    sync must still meet the down chunks' all-reduce (it hung until the collective timeout)."""
    ref = reference_run(tiny_config(layers), world // pp, gas, 2)
    results = [r[0] for r in run_ranks(world, engine_rank_runs, pp, gas, 2, PIPELINES, num_layers=layers,
                                      timeout=120)]
    assert_matches_reference(results, ref)
    for key in ref["weights"]:  # the idle replica's copies took the same steps
        copies = [r["weights"][key] for r in results if key in r["weights"]]
        assert len(copies) >= 2 and all(torch.equal(copies[0], c) for c in copies[1:]), key
