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
