"""A schedule file in the JSON export format: read back as written, or refused with the validator's
line when damaged (a missing op, a deadlock, a wrong rank count), or with one line naming the field
when it does not fit the run."""
import json

import pytest

from megatron_ds.schedules import Op, ScheduleError, build_schedule, from_file


def _write(tmp_path, schedule, edit=None):
    d = schedule.to_dict()
    if edit:
        edit(d)
    path = tmp_path / "s.json"
    path.write_text(json.dumps(d))
    return str(path)


def _op(kind, stage, mb):
    return Op(kind, 0, stage, mb).to_dict()


def test_an_export_reads_back_as_written(tmp_path):
    s = build_schedule("seq1f1b", 2, 4, seq_splits=2, segment_lengths=[10, 6])
    loaded = from_file.for_run(_write(tmp_path, s), 2, 4, [10, 6])
    assert loaded.to_dict() == s.to_dict()


def _drop_last_backward(d):
    d["ranks"][1] = [op for op in d["ranks"][1] if op != _op("BW", 1, 1)]


def _deadlock(d):
    # rank 0 runs BW0 before F1 while rank 1 runs F1 before F0: each waits for the other
    d["ranks"] = [[_op("F", 0, 0), _op("BW", 0, 0), _op("F", 0, 1), _op("BW", 0, 1)],
                  [_op("F", 1, 1), _op("F", 1, 0), _op("BW", 1, 0), _op("BW", 1, 1)]]


@pytest.mark.parametrize("edit,line", [
    (_drop_last_backward, "(replica 0, stage 1, mb 1, seq 0) has no backward (needs one BW or one B plus one W)"),
    (_deadlock, "deadlock: rank 0 waits at BW(r0,s0,mb0,q0) for BW(r0,s1,mb0,q0) on rank 1; "
                "rank 1 waits at F(r0,s1,mb1,q0) for F(r0,s0,mb1,q0) on rank 0"),
    (lambda d: d["ranks"].append([]), "schedule has 3 rank lists for pp=2"),
    (lambda d: d.pop("placement"), "schedule JSON lacks key(s) placement"),
    (lambda d: d.update(pp="two"), "not a schedule in the JSON export format"),
    (lambda d: d.update(segment_lengths=[8, 8]), "segment_lengths [8, 8] must hold seq_splits=1 positive"),
], ids=["missing-op", "deadlock", "rank-count", "no-placement", "bad-type", "segments"])
def test_a_damaged_file_gets_the_validators_line(tmp_path, edit, line):
    with pytest.raises(ScheduleError) as err:
        from_file.load(_write(tmp_path, build_schedule("1f1b", 2, 2), edit))
    assert line in str(err.value)


def test_the_run_must_fit_the_file(tmp_path):
    path = _write(tmp_path, build_schedule("seq1f1b", 2, 4, seq_splits=2, segment_lengths=[10, 6]))
    with pytest.raises(ScheduleError, match=r"holds op lists for pp=2 ranks; this run has --pipeline-model-par"):
        from_file.for_run(path, 4, 4)
    with pytest.raises(ScheduleError, match=r"runs micro_batches=4; this step has 8"):
        from_file.for_run(path, 2, 8)
    with pytest.raises(ScheduleError, match=r"segment_lengths \[10, 6\], the run into \[8, 8\]"):
        from_file.for_run(path, 2, 4, [8, 8])
    with pytest.raises(ScheduleError, match="cannot read it: No such file"):
        from_file.load(str(tmp_path / "missing.json"))
