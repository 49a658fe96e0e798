import pytest
import torch

from megatron_ds.model.context_parallel import ContextLayout, layout_problem


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_ranks_hold_every_position_once_in_balanced_pairs(cp):
    length = 8 * cp
    held = torch.cat([ContextLayout(cp, r).positions(length) for r in range(cp)])
    assert sorted(held.tolist()) == list(range(length))
    # causal cost of a rank: the keys each of its queries sees; equal on every rank
    costs = {int((ContextLayout(cp, r).positions(length) + 1).sum()) for r in range(cp)}
    assert len(costs) == 1


def test_positions_of_cp2_rank1_and_a_segment_offset():
    layout = ContextLayout(2, 1)
    assert layout.positions(8).tolist() == [2, 3, 4, 5]
    assert layout.positions(8, start=16).tolist() == [18, 19, 20, 21]


@pytest.mark.parametrize("cp", [2, 4])
def test_shard_takes_the_positions_and_unshard_restores(cp):
    t = torch.arange(3 * 16 * 5).view(3, 16, 5)
    parts = [ContextLayout(cp, r).shard(t, dim=1) for r in range(cp)]
    for r, part in enumerate(parts):
        assert torch.equal(part, t[:, ContextLayout(cp, r).positions(16)])
    assert torch.equal(ContextLayout(cp, 0).unshard(parts, dim=1), t)


def test_lengths_that_do_not_cut_into_2cp_chunks_are_named():
    assert "divisible by 2 x --context-parallel-size (4)" in layout_problem(6, 2)
    assert layout_problem(8, 2) == ""
    with pytest.raises(ValueError, match="divisible"):
        ContextLayout(2, 0).positions(6)
    with pytest.raises(ValueError, match="not in a group"):
        ContextLayout(2, 2)
