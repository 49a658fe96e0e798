import pytest

from megatron_ds.schedules import ScheduleError, build_schedule


@pytest.mark.parametrize("kwargs, message", [
    (dict(name="pipedream", pp=4, micro_batches=4), "unknown schedule 'pipedream'"),
    (dict(name="1f1b", pp=0, micro_batches=4), r"positive integer pp \(pp=0\)"),
    (dict(name="1f1b", pp=4, micro_batches=4, virtual_stages=2), "1f1b does not take virtual_stages=2"),
    (dict(name="gpipe", pp=4, micro_batches=4, seq_splits=2), "needs schedule seq1f1b"),
    (dict(name="1f1b", pp=4, micro_batches=4, split_backward=True), "does not take split_backward"),
])
def test_refuses_bad_settings(kwargs, message):
    with pytest.raises(ScheduleError, match=message):
        build_schedule(**kwargs)


@pytest.mark.parametrize("name", ["zbv", "bitpipe"])
@pytest.mark.parametrize("v", [2, 3])
def test_a_knob_the_schedule_fixes_is_refused(name, v):
    # One rule for ds_config and build_schedule: zbv and bitpipe always hold 2 chunks per
    # rank, so virtual_stages is not theirs to set, not even to its own value.
    with pytest.raises(ScheduleError, match=f"{name} does not take virtual_stages={v}: "
                                            f"{name} always places 2 chunks per rank"):
        build_schedule(name, 4, 8, virtual_stages=v)
    assert build_schedule(name, 4, 8).stages == 8


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2", "zbv"])
def test_split_backward_on_an_always_split_schedule_is_refused(name):
    with pytest.raises(ScheduleError, match=f"{name} does not take split_backward=True: "
                                            "it always splits the backward into B and W"):
        build_schedule(name, 4, 8, split_backward=True)


def test_interleaved_with_one_chunk_is_1f1b():
    one = build_schedule("1f1b", 4, 6)
    inter = build_schedule("interleaved", 4, 6)
    assert inter.name == "interleaved" and inter.ranks == one.ranks
