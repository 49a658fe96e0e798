import pytest

from megatron_ds.schedules import SCHEDULE_NAMES, ScheduleError, build_schedule


def test_names():
    assert SCHEDULE_NAMES == ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zbv",
                              "bitpipe", "seq1f1b")


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


def test_v_schedules_accept_their_own_chunk_count():
    assert build_schedule("zbv", 4, 8, virtual_stages=2).stages == 8
    assert build_schedule("bitpipe", 4, 8, virtual_stages=2).stages == 8
    with pytest.raises(ScheduleError, match="zbv always uses 2 chunks per replica and rank"):
        build_schedule("zbv", 4, 8, virtual_stages=3)


def test_interleaved_with_one_chunk_is_1f1b():
    one = build_schedule("1f1b", 4, 6)
    inter = build_schedule("interleaved", 4, 6)
    assert inter.name == "interleaved" and inter.ranks == one.ranks


def test_seq_costs_checked():
    build_schedule("seq1f1b", 2, 2, seq_splits=2, seq_costs=[1.2, 0.8])
    with pytest.raises(ScheduleError, match="seq_costs must be 2 positive numbers"):
        build_schedule("seq1f1b", 2, 2, seq_splits=2, seq_costs=[1.0])
    with pytest.raises(ScheduleError, match="1f1b does not take seq_costs"):
        build_schedule("1f1b", 2, 2, seq_costs=[1.0])
