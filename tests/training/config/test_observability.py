"""--log-level, --profile and the per-machine codecarbon tracker, without a training run
(tests/training/test_shipped_ds_configs.py checks them inside a real one)."""
import json
import logging
import os
import re
import subprocess
import sys
import types

import pytest

from megatron_ds.training.config.arguments import ArgumentsError
from megatron_ds.testing.launcher import child_env
from megatron_ds.training.config.observability import Profile, apply_log_level, check_observability_args

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


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


def test_validation_block_goes_through_the_progress_bar_and_the_last_eval_is_printed_once(capsys):
    from megatron_ds.training.logging_utils import Timers
    from megatron_ds.training.loop import Cadence, Trainer
    trainer = Trainer.__new__(Trainer)  # only what maybe_validate and finish touch
    trainer.args = types.SimpleNamespace(batch_schedule=None, eval_iters=1, save=None, save_interval=None,
                                         eval_interval=4, load=None)
    trainer.engine = types.SimpleNamespace(eval_batch=lambda it: 2.5)
    trainer.timers, trainer.current_gbs, trainer.iteration, trainer.consumed_train = Timers(), 8, 4, 32
    trainer.consumed_valid = 0
    trainer.tb = types.SimpleNamespace(validation=lambda *a, **k: calls.append(a), timer=lambda *a: None)
    trainer.valid_points, trainer.valid_iter, trainer.test_ds, calls = [], object(), None, []
    trainer.cadence = Cadence(trainer.args, 0, validates=True)
    written = []
    trainer.bar = types.SimpleNamespace(write=written.append)
    trainer.maybe_validate("iteration 4")
    assert len(written) == 1 and "validation loss at iteration 4" in written[0]  # tqdm's write clears the bar
    trainer.bar = None
    trainer.finish()  # iteration 4 was just evaluated: not evaluated, logged or printed again
    assert len(calls) == 1 and trainer.valid_points == [(4, 2.5)] and trainer.consumed_valid == 8
    assert "validation loss" not in capsys.readouterr().out


TIDY = """
import sys, warnings
from megatron_ds.training.config.observability import tidy_output
tidy_output(int(sys.argv[1]))
import deepspeed  # without CUDA its logger warns "Setting accelerator to CPU" as it is imported
warnings.warn_explicit("`torch.distributed.all_gather_into_tensor` is deprecated", FutureWarning,
                       "c10d_logger.py", 83, module="torch.distributed.c10d_logger")
warnings.warn_explicit("a warning of ours", UserWarning, "loop.py", 1, module="megatron_ds.training.loop")
"""


def test_what_every_rank_says_the_same_is_said_by_rank_0_alone():
    """Four ranks printed four copies of DeepSpeed's accelerator warning and of torch's deprecation of the call
    DeepSpeed's ZeRO makes; the other ranks keep those to themselves, not their own warnings."""
    import torch
    env = child_env(ROOT)
    # DeepSpeed warns only when it detects the accelerator itself: not when a tool run earlier in this test
    # process named it (convert/cli.py sets DS_ACCELERATOR=cpu), which the children would inherit
    env.pop("DS_ACCELERATOR", None)
    procs = {rank: subprocess.Popen([sys.executable, "-c", TIDY, str(rank)], stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, env=env)
             for rank in (0, 1)}
    out = {rank: proc.communicate(timeout=300)[0] for rank, proc in procs.items()}
    assert all(proc.returncode == 0 for proc in procs.values()), out
    if not torch.cuda.is_available():
        assert "Setting accelerator to CPU" in out[0] and "Setting accelerator to CPU" not in out[1], out
    assert "all_gather_into_tensor` is deprecated" in out[0] and "is deprecated" not in out[1], out
    assert "a warning of ours" in out[0] and "a warning of ours" in out[1], out


LINES = """
import sys
from megatron_ds.training.config.observability import tidy_output
tidy_output(int(sys.argv[1]))
for i in range(3000):
    print(f"rank {sys.argv[1]} line {i} " + "x" * 60, flush=True)
"""


def test_two_ranks_lines_never_share_a_line():
    """Under `python -u` (torchrun and the deepspeed launcher start ranks so) print() wrote a line and its
    newline apart, and the other rank's line landed between them: two ranks' prints on one line."""
    read, write = os.pipe()
    procs = [subprocess.Popen([sys.executable, "-u", "-c", LINES, str(rank)], stdout=write, env=child_env(ROOT))
             for rank in (0, 1)]
    os.close(write)
    with os.fdopen(read) as f:
        lines = f.read().splitlines()
    assert [proc.wait(timeout=300) for proc in procs] == [0, 0]
    assert len(lines) == 6000
    merged = [line for line in lines if not re.fullmatch(r"rank [01] line \d+ x{60}", line)]
    assert merged == [], merged[:5]
