"""The coupled ring (schedules/context_parallel.coupled_ring): every rank's ring steps with its own compute, worked
by hand; with equal ranks it is ring_times to the last bit."""
import pytest
from megatron_ds.schedules.context_parallel import coupled_ring, messages, rank_attention_flops, ring_times
from megatron_ds.schedules.ir import ScheduleError

from tests.schedules.test_context_parallel import SHAPE


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("ratio", [0.25, 0.5, 1.0, 2.0, 3.0])  # a K/V block's transfer over a forward step's compute
def test_equal_ranks_are_ring_times(cp, ratio):
    att = rank_attention_flops(SHAPE, 64, cp, 0)
    block_bytes, grad_bytes = (m.size for m in messages(SHAPE, 64, cp, "p2p").backward)
    bandwidth = block_bytes / (att / cp * ratio)
    ring = ring_times(SHAPE, 64, cp, "p2p", flops=1.0, bandwidth=bandwidth)
    kv, grad = block_bytes / bandwidth, grad_bytes / bandwidth
    start = 0.75
    for side, step in ((0, att / cp), (1, 2 * att / cp)):
        coupled = coupled_ring([[step] * cp] * cp, kv, grad, backward=bool(side), starts=[start] * cp)
        assert coupled.transfer == pytest.approx(ring.transfer[side], rel=1e-15)
        assert coupled.lag == (0.0,) * cp  # nobody waits for a neighbour's post
        for r in range(cp):
            assert coupled.exposed[r] == pytest.approx(ring.exposed[side], rel=1e-12, abs=1e-12 * step)
            assert coupled.ends[r] - start == pytest.approx(cp * step + ring.exposed[side], rel=1e-12)


def test_equal_ranks_are_ring_times_to_the_bit():
    # a K/V block's transfer as long as a forward step's attention: whole numbers of FLOPs and bytes, where the two
    # ways of summing round alike
    att = rank_attention_flops(SHAPE, 64, 4, 0)
    block_bytes, grad_bytes = (m.size for m in messages(SHAPE, 64, 4, "p2p").backward)
    ring = ring_times(SHAPE, 64, 4, "p2p", flops=1.0, bandwidth=block_bytes / (att / 4))
    kv, grad = att / 4, att / 4 * grad_bytes / block_bytes
    fwd = coupled_ring([[att / 4] * 4] * 4, kv, grad)
    back = coupled_ring([[2 * att / 4] * 4] * 4, kv, grad, backward=True)
    assert fwd.exposed == (ring.exposed[0],) * 4 and back.exposed == (ring.exposed[1],) * 4
    assert back.ends == (2 * att + ring.exposed[1],) * 4 and (fwd.transfer, back.transfer) == ring.transfer


def test_one_slower_rank_costs_the_sum_of_each_steps_slower_block():
    # CP 2, rank 1 twice as slow at every step; a K/V block 0.5 s, a gradient block 1.5 s.
    # forward: step 0 carries the K/V block (both post at 0, it arrives at 0.5, under either block); step 1 posts
    # nothing: rank 0 leaves at 2, rank 1 at 4 = max(1, 2) + max(1, 2), the sum of the per-step maxima
    fwd = coupled_ring([[1.0, 1.0], [2.0, 2.0]], kv=0.5, grad=1.5)
    assert fwd.ends == (2.0, 4.0) and fwd.exposed == (0.0, 0.0) and fwd.lag == (0.0, 0.0) and fwd.transfer == 0.5
    # backward: step 0 as forward (ends 1 and 2); step 1 carries step 0's gradient block, which leaves when the later
    # rank posts (2) and arrives at 3.5: rank 0 (done at 2) waits 1.5 s for it, rank 1 (done at 4) not at all; the
    # last gradient block leaves at 4 (rank 1's post; rank 0 waited 0.5 s for it) and arrives at 5.5:
    # max(1, 2) + max(1, 2) + 1.5 exposed = 5.5 on both
    back = coupled_ring([[1.0, 1.0], [2.0, 2.0]], kv=0.5, grad=1.5, backward=True)
    assert back.ends == (5.5, 5.5)
    assert back.exposed == (3.0, 1.5) and back.lag == (0.5, 0.0) and back.transfer == 0.5 + 2 * 1.5
    assert back.hidden == (1 - 3.0 / 3.5, 1 - 1.5 / 3.5)
    # rank 0 enters 1.5 s after rank 1: rank 1, done with its first block at 1, waits 0.5 s for rank 0's post and
    # 0.5 s more for the block (at 2); rank 0 finds it there when done (2.5). Each adds its second block
    late = coupled_ring([[1.0, 1.0], [1.0, 1.0]], kv=0.5, starts=[1.5, 0.0])
    assert late.ends == (3.5, 3.0) and late.lag == (0.0, 0.5) and late.exposed == (0.0, 0.5)


def test_a_rank_runs_one_step_ahead_when_the_slower_one_alternates():
    # the slower rank alternates (3 s against 1 s): a step's transfer waits for the neighbours' posts at its start,
    # not for their compute, so each rank attends its next block while the other finishes: forward both leave at 4
    # (each one's own sum), not at 3 + 3 (the per-step maxima)
    fwd = coupled_ring([[3.0, 1.0], [1.0, 3.0]], kv=0.5)
    assert fwd.ends == (4.0, 4.0) and fwd.lag == (0.0, 0.0)
    # backward: step 1's gradient block leaves at 3 (rank 0's post) and is there at 3.5, before either is done (4);
    # the last one leaves at 4: 4.5 on both
    back = coupled_ring([[3.0, 1.0], [1.0, 3.0]], kv=0.5, grad=0.5, backward=True)
    assert back.ends == (4.5, 4.5) and back.exposed == (0.5, 0.5) and back.lag == (0.0, 0.0)
    # four ranks, rank 2 entering 2 s late: rank r receives from r - 1 and sends to r + 1, so a step waits for both
    # neighbours' posts and the delay spreads one hop a step. Step 0: ranks 1 and 3 wait for rank 2's post (2) and
    # the block (2.25); rank 0 does not (1). Step 1: rank 0 waits for theirs (2.25 + 0.25 = 2.5), ranks 1 and 3 for
    # rank 2's (3 + 0.25, just as their compute ends). Step 2: rank 0 for theirs (3.25 + 0.25 = 3.5: its compute's
    # end too), ranks 1 and 3 for rank 2's (4 + 0.25). Step 3 posts nothing: each adds its last block
    four = coupled_ring([[1.0] * 4] * 4, kv=0.25, starts=[0.0, 0.0, 2.0, 0.0])
    assert four.ends == (4.5, 5.25, 6.0, 5.25)
    assert four.lag == (0.25, 1.0, 0.0, 1.0) and four.exposed == (0.25, 0.25, 0.0, 0.25)
    assert coupled_ring([[2.0]], kv=9.0, backward=True).ends == (2.0,)  # one rank: no ring


def test_coupled_ring_refuses_steps_that_do_not_match_the_ranks():
    with pytest.raises(ScheduleError, match="each of the 2 ranks needs 2 ring steps"):
        coupled_ring([[1.0], [1.0, 2.0]], kv=1.0)
    with pytest.raises(ScheduleError, match="1 start times for 2 ranks"):
        coupled_ring([[1.0, 1.0], [1.0, 1.0]], kv=1.0, starts=[0.0])
