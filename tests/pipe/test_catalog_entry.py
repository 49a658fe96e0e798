"""Adding a schedule is a generator and one catalogue entry: a test-local schedule, never
seen by the engine before, trains on ScheduleEngine exactly as the single-process reference; a
two-chunk one takes Megatron-LM's virtual-stage flag and is a candidate (and a start) of "auto"."""
import json

import pytest

from megatron_ds.pipe.plan.config import ConfigError, pipeline_settings
from megatron_ds.schedules import CATALOG, Op, Schedule, ScheduleError, ScheduleSpec
from megatron_ds.schedules import placement
from megatron_ds.schedules import auto as auto_choice
from megatron_ds.schedules.catalog import ALWAYS, ANY
from megatron_ds.testing.launcher import run_ranks
from megatron_ds.training.config.arguments import ArgumentsError, parse_args
from tests.gpt_harness import assert_matches_reference, engine_rank_run, reference_run, tiny_config


def serial(pp, m, virtual_stages):
    """One micro-batch at a time: its forward through every chunk, then its backward."""
    stages = pp * virtual_stages
    ranks = [[] for _ in range(pp)]
    for mb in range(m):
        for r in range(pp):
            mine = range(r, stages, pp)
            ranks[r] += [Op("F", 0, s, mb) for s in mine] + [Op("BW", 0, s, mb) for s in reversed(mine)]
    return Schedule("serial", pp, m, 1, stages, 1, placement.interleaved(pp, virtual_stages), ranks)


def _even_micro_batches(pp, m, v, k):
    if m % 2:
        raise ScheduleError(f"serial needs an even number of micro-batches (micro_batches={m})")


SERIAL = ScheduleSpec("serial", serial, virtual_stages=ANY, check=_even_micro_batches)


@pytest.fixture
def catalogued(monkeypatch):
    monkeypatch.setitem(CATALOG, SERIAL.name, SERIAL)


def test_the_entry_is_checked_like_any_schedule(catalogued):
    settings = pipeline_settings({"pipeline": {"schedule": "serial", "virtual_stages": 2}})
    assert settings.build_schedule(2, 4).stages == 4
    with pytest.raises(ScheduleError, match=r"micro_batches=3"):
        settings.build_schedule(2, 3)
    with pytest.raises(ConfigError, match="serial does not take seq_splits=2"):
        pipeline_settings({"pipeline": {"schedule": "serial", "seq_splits": 2}})


def _train_serial(*args, **kw):
    CATALOG[SERIAL.name] = SERIAL  # this rank's process registers the entry, as a package module would
    return engine_rank_run(*args, **kw)


def test_a_new_catalogue_entry_trains_like_the_reference():
    steps, gas = 3, 4
    ref = reference_run(tiny_config(4), 1, gas, steps)
    results = run_ranks(2, _train_serial, 2, gas, steps, {"schedule": "serial", "virtual_stages": 2},
                        num_layers=4, timeout=600)
    assert_matches_reference(results, ref)
    assert [r["engine"]["chunks"] for r in results] == [[(0, 0), (0, 2)], [(0, 1), (0, 3)]]


def serial_v(pp, m):
    """Two chunks per rank in a V (rank r holds stages r and 2pp-1-r), one micro-batch at a time, the
    backward split into B then W."""
    stages = 2 * pp
    where = placement.v_shape(pp)[0]
    ranks = [[] for _ in range(pp)]
    for mb in range(m):
        for s in range(stages):
            ranks[where[s]].append(Op("F", 0, s, mb))
        for s in reversed(range(stages)):
            ranks[where[s]] += [Op("B", 0, s, mb), Op("W", 0, s, mb)]
    return Schedule("serial-v", pp, m, 1, stages, 1, [where], ranks)


SERIAL_V = ScheduleSpec("serial-v", serial_v, virtual_stages=2, split_backward=ALWAYS)


@pytest.fixture
def two_chunks(monkeypatch):
    monkeypatch.setitem(CATALOG, SERIAL_V.name, SERIAL_V)


def test_a_new_two_chunk_entry_takes_the_virtual_stage_flag_and_is_an_auto_candidate(two_chunks, tmp_path,
                                                                                      monkeypatch):
    monkeypatch.chdir(tmp_path)
    for ext in (".bin", ".idx"):
        (tmp_path / f"corpus{ext}").write_bytes(b"")
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 1},
                                                  "pipeline": {"schedule": "serial-v"}}))
    flags = ["--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
             "--lr", "1e-3", "--train-iters", "2", "--data-path", "corpus", "--vocab-file", __file__,
             "--merge-file", __file__, "--micro-batch-size", "1", "--global-batch-size", "4",
             "--pipeline-model-parallel-size", "2", "--deepspeed_config", "ds.json"]
    env = {"WORLD_SIZE": "2", "RANK": "0"}
    args = parse_args(flags + ["--num-layers-per-virtual-pipeline-stage", "2"], env=env)  # Megatron-LM's flag
    assert args.pipeline_settings.schedule == "serial-v"
    with pytest.raises(ArgumentsError, match="gives 4 virtual stages per rank, but schedule 'serial-v' always uses 2"):
        parse_args(flags + ["--num-layers-per-virtual-pipeline-stage", "1"], env=env)
    pp, m, layers = 2, 4, 8
    assert auto_choice.Candidate("serial-v") in dict(auto_choice.candidates(pp, m, layers))
    # it holds one micro-batch at a time: the only schedule that splits B and W within a budget of 1
    assert auto_choice.peak_memory(serial_v(pp, m)) == 1
    assert auto_choice.check_budget(1, pp, m, layers) == auto_choice.Candidate("serial-v")
