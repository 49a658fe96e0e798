"""DualPipeV in the IR (B/W split as DualPipe's reference) against DeepSpeed's own DualPipeV."""
import pytest

from bench.ds_replay import replay
from megatron_ds.schedules import build_schedule, order_text, simulate


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 16), (8, 16)])
@pytest.mark.parametrize("costs", [(1, 1, 1), (1, 1, 0.5), (1, 2, 1)])
def test_below_deepspeeds_dualpipev(p, m, costs):
    ours = simulate(build_schedule("dualpipev", p, m), *costs).makespan
    theirs = replay("dualpipev", p, m, *costs)
    assert ours < theirs
    assert ours < replay("1f1b", p, m, *costs)


def test_numbers_at_p4():
    res = simulate(build_schedule("dualpipev", 4, 8))
    assert res.makespan == 25.5                   # DeepSpeed's DualPipeV: 31, 1F1B: 33
    assert replay("dualpipev", 4, 8, 1, 1, 1) == 31
    assert res.peak_memory == [4.5] * 4           # p+1 chunk activations of 1/2 each


def test_reference_steps_on_the_last_rank():
    # Rank p-1: (F0 F1) pairs, then the steady (F0 BW1 F1 BW0), the tail splits half the B's.
    text = order_text(build_schedule("dualpipev", 2, 4), [1])
    assert text == ("rank1: F0 F0' F1 F1' F2 BW0' F2' BW0 F3 BW1' F3' BW1 BW2' BW2 B3' B3 W3' W3")


@pytest.mark.parametrize("m, makespan", [(1, 10.5), (2, 12.5), (4, 16.5), (7, 23.5)])
def test_fewer_than_2p_micro_batches(m, makespan):
    # Played for 2p micro-batches, the missing ones left out; still below 1F1B's (m+p-1)*3.
    res = simulate(build_schedule("dualpipev", 4, m))
    assert res.makespan == makespan < (m + 3) * 3
