"""The mpu's groups equal DeepSpeed's PipelineParallelGrid's on PipeModelDataParallelTopology."""
import pytest

from .ranks import LAYOUTS

# (pp, tp, dp) -> rank 0's (tensor, pipe, data, model-replica) groups; model (TP) is the fastest axis
RANK0_GROUPS = {(2, 2, 1): ([0, 1], [0, 2], [0], [0, 1, 2, 3]),
                (1, 2, 2): ([0, 1], [0], [0, 2], [0, 1]),
                (1, 4, 1): ([0, 1, 2, 3], [0], [0], [0, 1, 2, 3])}


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: "pp%d-tp%d-dp%d" % layout)
def test_groups_match_deepspeeds_topology(tp_results, layout):
    results = tp_results(4)
    for rank, r in enumerate(results):
        ours, theirs = r["groups"][layout]
        assert ours == theirs, rank
        assert ours["size"] == (layout[1], layout[0], layout[2], layout[0] * layout[1])
    ours0 = results[0]["groups"][layout][0]
    assert (ours0["tensor"], ours0["pipe"], ours0["data"], ours0["model"]) == RANK0_GROUPS[layout]
