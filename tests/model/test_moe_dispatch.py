"""The test-only all-to-all latency (MEGATRON_DS_TEST_A2A_LATENCY_MS): every all-to-all of the
dispatch takes that much longer, inside AllToAllTimes' interval, with its data unchanged; issued inside an
overlapped unit it is a deadline, which the other side's work counts towards; a bad value is one line. The
collective is replaced by a copy here (one process, no group)."""
import threading
import time

import pytest
import torch

from megatron_ds.model import moe_dispatch
from megatron_ds.model.moe_dispatch import TEST_LATENCY_ENV, AddedLatency, AllToAllTimes, InFlight, added_latency


@pytest.fixture
def collective(monkeypatch):
    """dist.all_to_all_single as one rank's: out = x; the calls are counted."""
    calls = []

    def all_to_all_single(out, x, out_splits=None, in_splits=None, group=None):
        calls.append(time.perf_counter())
        out.copy_(x)
    monkeypatch.setattr(moe_dispatch.dist, "all_to_all_single", all_to_all_single)
    return calls


@pytest.mark.parametrize("timed", [False, True])
def test_latency_is_added_after_the_collective_and_inside_the_timed_interval(monkeypatch, collective, timed):
    monkeypatch.setenv(TEST_LATENCY_ENV, "30")
    monkeypatch.setattr(AllToAllTimes, "intervals", [] if timed else None)
    x = torch.arange(12.0).view(6, 2)
    out = torch.empty_like(x)
    start = time.perf_counter()
    moe_dispatch._all_to_all(out, x, [6], [6])
    took = time.perf_counter() - start
    assert torch.equal(out, x) and len(collective) == 1
    assert took >= 0.030 and time.perf_counter() - collective[0] >= 0.030  # the sleep follows the collective
    if timed:
        (begin, end), = AllToAllTimes.intervals
        assert begin <= collective[0] and end - begin >= 0.030


def test_unset_or_zero_adds_nothing(monkeypatch):
    monkeypatch.delenv(TEST_LATENCY_ENV, raising=False)
    assert added_latency() == 0.0
    monkeypatch.setenv(TEST_LATENCY_ENV, "0")
    assert added_latency() == 0.0
    monkeypatch.setenv(TEST_LATENCY_ENV, "2.5")
    assert added_latency() == 0.0025


@pytest.mark.parametrize("value", ["fast", "-1", "nan"])
def test_a_bad_latency_is_one_line(monkeypatch, value):
    monkeypatch.setenv(TEST_LATENCY_ENV, value)
    with pytest.raises(RuntimeError, match=f"{TEST_LATENCY_ENV}=.*milliseconds >= 0"):
        added_latency()


def test_an_issued_all_to_all_sleeps_only_what_the_other_side_left(monkeypatch):
    """Issued at 0, its transfer done at 20 ms, the other side's work until 40 ms, then waited: due at 20 + 50 ms
    (the latency counts from the transfer's end, as after a blocking one), so about 30 of the 50 ms slept;
    blocking: all 50. The moments are read as they happened (a loaded machine runs the timer and the sleep late):
    what was slept is what was left of the 50 ms after the transfer's end when the wait returned."""
    monkeypatch.setenv(TEST_LATENCY_ENV, "50")
    monkeypatch.setattr(AddedLatency, "added", 0.0)
    monkeypatch.setattr(AddedLatency, "slept", 0.0)
    issued, waited, timers, finished = [], [], [], []

    class Future:
        def add_done_callback(self, callback):
            def transfer_done():
                finished.append(time.perf_counter())
                callback(self)
            timers.append(threading.Timer(0.020, transfer_done))
            timers[-1].start()

    class Work:
        def get_future(self):
            return Future()

        def wait(self):  # as gloo's: returns once the transfer is done and its callbacks have run
            waited.append(time.perf_counter())
            timers[-1].join()
            waited.append(time.perf_counter())

    def all_to_all_single(out, x, out_splits=None, in_splits=None, group=None, async_op=False):
        out.copy_(x)
        issued.append(async_op)
        return Work() if async_op else None
    monkeypatch.setattr(moe_dispatch.dist, "all_to_all_single", all_to_all_single)
    x = torch.arange(6.0)
    out = torch.empty_like(x)
    monkeypatch.setattr(InFlight, "meanwhile", lambda: time.sleep(0.040))
    start = time.perf_counter()
    moe_dispatch._all_to_all(out, x)
    assert torch.equal(out, x) and issued == [True] and waited[0] - start >= 0.040  # waited after the other side
    left = finished[0] + 0.050 - waited[1]  # what the wait left of the latency; the sleep began just after
    assert AddedLatency.added == pytest.approx(0.050) and AddedLatency.slept <= max(0.0, left)
    assert AddedLatency.slept == pytest.approx(max(0.0, left), abs=0.010)
    assert time.perf_counter() - finished[0] >= 0.050  # never complete before the transfer's end plus the latency
    monkeypatch.setattr(InFlight, "meanwhile", None)
    moe_dispatch._all_to_all(out, x)
    assert issued == [True, False] and AddedLatency.slept > 0.045


def test_a_moe_layer_built_before_its_expert_groups_is_one_user_line(monkeypatch):
    """Expert parallelism asks DeepSpeed's registry for its group; none made: a UserError that names the call a
    user's own PipelineModule makes first (not a traceback into the runtime's internals)."""
    from types import SimpleNamespace
    from deepspeed.utils import groups
    from megatron_ds.errors import UserError
    monkeypatch.setattr(groups, "_get_expert_parallel_group_dict", dict)  # no group made in this process
    with pytest.raises(UserError, match=r"expert parallelism 2: its process groups are not made.*"
                                        r"expert_parallel_groups\(config, num_stages\)") as err:
        moe_dispatch.expert_parallel_group(SimpleNamespace(expert_model_parallel_size=2))
    assert "\n" not in str(err.value)
