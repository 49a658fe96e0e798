import json

import pytest

from megatron_ds.schedules import Op, Schedule, ScheduleError, build_schedule


def test_op_fields_and_dict():
    op = Op("B", 1, 3, 5, 2)
    assert [f for f in op.__dataclass_fields__] == ["kind", "replica", "stage", "mb", "seq"]
    assert op.to_dict() == {"op": "B", "replica": 1, "stage": 3, "mb": 5, "seq": 2}
    assert Op.from_dict(op.to_dict()) == op
    assert len({op, Op("B", 1, 3, 5, 2)}) == 1


def test_op_from_dict_rejects_bad_kind():
    with pytest.raises(ScheduleError, match="kind"):
        Op.from_dict({"op": "X", "replica": 0, "stage": 0, "mb": 0, "seq": 0})


def test_json_round_trip_and_contract_keys():
    s = build_schedule("1f1b", 4, 8)
    d = json.loads(s.to_json())
    assert list(d) == ["schedule", "pp", "micro_batches", "replicas", "stages", "seq_splits",
                       "placement", "ranks"]
    assert d["placement"] == [[0, 1, 2, 3]]
    assert d["ranks"][3][:2] == [{"op": "F", "replica": 0, "stage": 3, "mb": 0, "seq": 0},
                                {"op": "BW", "replica": 0, "stage": 3, "mb": 0, "seq": 0}]
    assert Schedule.from_json(s.to_json()) == s
    assert Schedule.from_json(s.to_json(indent=2)) == s
    assert json.loads(s.to_json(indent=2)) == d


def test_from_json_names_missing_key():
    with pytest.raises(ScheduleError, match="placement"):
        Schedule.from_json('{"schedule": "x", "pp": 1, "micro_batches": 1, "replicas": 1, '
                           '"stages": 1, "seq_splits": 1, "ranks": [[]]}')


def test_rank_of_chunks_on_loss_stage():
    s = build_schedule("1f1b", 4, 4)
    assert s.rank_of(0, 2) == 2
    assert s.chunks_on(1) == [(0, 1)]
    assert s.loss_stage == 3


def test_an_op_pickled_in_another_process_equals_and_hashes_as_a_new_one(tmp_path):
    """Ops cache their hash; a str's hash differs between processes (spawned ranks), so unpickling rebuilds it."""
    import os
    import pickle
    import subprocess
    import sys
    path = tmp_path / "op.pkl"
    code = ("import pickle, sys; from megatron_ds.schedules.ir import Op; "
            f"open({str(path)!r}, 'wb').write(pickle.dumps(Op('BW', 1, 2, 3, 0)))")
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": os.getcwd()}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
    theirs, ours = pickle.loads(path.read_bytes()), Op("BW", 1, 2, 3, 0)
    assert theirs == ours and hash(theirs) == hash(ours) and {ours: 1}[theirs] == 1
