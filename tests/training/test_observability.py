"""--log-level, --profile and the per-machine codecarbon tracker, without a training run
(tests/training/test_shipped_ds_configs.py checks them inside a real one)."""
import json
import logging
import types

import pytest

from megatron_ds.training.arguments import ArgumentsError
from megatron_ds.training.observability import Profile, apply_log_level, check_observability_args


def _args(**kw):
    base = dict(log_level="passive", log_level_replica=None, profile=False, profile_step_start=10,
                profile_step_end=12, profile_ranks=[0], profile_dir=None, tensorboard_dir=None, world_size=4)
    base.update(kw)
    return types.SimpleNamespace(**base)


def test_log_levels_for_rank_0_and_the_replicas():
    from deepspeed.utils import logger as ds_logger
    before = ds_logger.level, logging.getLogger().level
    try:
        args = _args(log_level="warning", log_level_replica="error")
        check_observability_args(args)
        assert apply_log_level(args, 0) is False and ds_logger.level == logging.WARNING  # no argument dump
        assert apply_log_level(args, 3) is False and ds_logger.level == logging.ERROR
        args = _args(log_level="debug")
        check_observability_args(args)
        assert args.log_level_replica == "debug" and apply_log_level(args, 1) is True
        ds_logger.setLevel(logging.INFO)
        assert apply_log_level(_args(), 0) is True and ds_logger.level == logging.INFO  # passive: untouched
    finally:
        ds_logger.setLevel(before[0])
        logging.getLogger().setLevel(before[1])


@pytest.mark.parametrize("kw, message", [
    (dict(profile_step_start=5, profile_step_end=5), "need 0 <= start < end"),
    (dict(profile_ranks=[4]), "--profile-ranks 4: not a rank of this run"),
])
def test_bad_profile_window(kw, message):
    with pytest.raises(ArgumentsError, match=message):
        check_observability_args(_args(profile=True, **kw))


def test_profile_records_its_window_with_the_op_names(tmp_path):
    import torch

    from megatron_ds.pipe.trace import Tracer
    from megatron_ds.schedules import build_schedule
    sched = build_schedule("zbv", 2, 2)
    engine = types.SimpleNamespace(sched=sched, stage_id=0)
    tracer = Tracer()  # no trace_dir: only the profiler's names

    def work(eng, **kw):
        torch.ones(64, 64) @ torch.ones(64, 64)
    profile = Profile(_args(profile=True, profile_step_start=1, profile_step_end=2, profile_dir=str(tmp_path)), 0)
    for done in range(4):  # iterations 1..4; only iteration 2 is recorded
        profile.before_iteration(done)
        tracer.instruction("ForwardOp", work, engine, dict(replica=0, stage=3, mb=done, seq=0))
        tracer.instruction("BackwardInputOp", work, engine, dict(replica=0, stage=0, mb=done, seq=0))
        tracer.instruction("OptimizerStep", work, engine, {})
    profile.stop()
    events = json.loads((tmp_path / "profile_rank00000_iterations2-2.json").read_text())["traceEvents"]
    labels = {e["name"] for e in events if e.get("cat") == "user_annotation"}
    assert labels == {"F1'", "B1", "OptimizerStep"}  # stage 3 is rank 0's second chunk of the V
    assert any(e["name"].startswith("aten::mm") for e in events)


def test_codecarbon_runs_once_per_machine(tmp_path, monkeypatch):
    import socket

    from megatron_ds.training.logging_utils import CodeCarbon
    assert CodeCarbon(str(tmp_path / "other"), "FRA", local_rank=1).tracker is None
    assert not (tmp_path / "other").exists()
    tracker = CodeCarbon(str(tmp_path / "cc"), "FRA", local_rank=0)
    assert tracker.tracker is not None
    tracker.stop()
    assert [p.name for p in (tmp_path / "cc").iterdir()] == [f"emissions-{socket.gethostname()}.csv"]


def test_validation_block_goes_through_the_progress_bar_and_the_last_eval_is_not_repeated(capsys):
    from megatron_ds.training.logging_utils import Timers
    from megatron_ds.training.loop import Trainer
    trainer = Trainer.__new__(Trainer)  # only what evaluate_and_print and finish touch
    trainer.args = types.SimpleNamespace(batch_schedule=None, eval_iters=1)
    trainer.engine = types.SimpleNamespace(eval_batch=lambda it: 2.5)
    trainer.timers, trainer.current_gbs, trainer.iteration, trainer.consumed_train = Timers(), 8, 4, 32
    trainer.tb = types.SimpleNamespace(validation=lambda *a, **k: calls.append(a))
    trainer.valid_points, trainer.valid_iter, trainer.test_ds, calls = [], object(), None, []
    written = []
    trainer.bar = types.SimpleNamespace(write=written.append)
    trainer.valid_points.append((4, trainer.evaluate_and_print("iteration 4", None, 1)[0]))
    assert len(written) == 1 and "validation loss at iteration 4" in written[0]  # tqdm's write clears the bar
    trainer.bar = None
    trainer.finish()  # iteration 4 was just evaluated: printed again, not evaluated or logged again
    assert len(calls) == 1 and trainer.valid_points == [(4, 2.5)]
    assert "validation loss at the end of training for val data" in capsys.readouterr().out
