"""Every bad-input error is a UserError: the entry points catch that one type and exit with 2."""
import importlib
import json

import pytest

from megatron_ds.errors import UserError

ERRORS = [("megatron_ds.training.config.arguments", "ArgumentsError"), ("megatron_ds.pipe.plan.config", "ConfigError"),
          ("megatron_ds.schedules", "ScheduleError"), ("megatron_ds.data.tokenizer", "TokenizerError"),
          ("megatron_ds.data.dataset_utils", "DataConfigError"),
          ("megatron_ds.data.indexed_dataset", "IndexedDatasetError"),
          ("megatron_ds.training.checkpoint.save_load", "CheckpointError"),
          ("megatron_ds.data.preprocessing", "PreprocessError"), ("megatron_ds.convert", "ToolError"),
          ("megatron_ds.parallel_layout", "ParallelConfigError")]


@pytest.mark.parametrize("module,name", ERRORS)
def test_is_a_user_error(module, name):
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, UserError) and cls("x").exit_code == 2


def test_pretrain_main_exits_2_on_a_user_error(capsys, monkeypatch):
    from megatron_ds.data.dataset_utils import DataConfigError
    from megatron_ds.training import loop
    monkeypatch.setattr(loop, "parse_args", lambda argv: None)

    def fail(args):
        raise DataConfigError("--split 'x': bad")
    monkeypatch.setattr(loop, "pretrain", fail)
    assert loop.main([]) == 2
    assert capsys.readouterr().err == "pretrain_gpt.py: error: --split 'x': bad\n"


def test_print_error_writes_the_line_and_its_newline_at_once(monkeypatch):
    """Under `python -u` print() writes a line and its newline apart: two ranks' lines then ran together
    on torchrun's shared pipe ("...completepretrain_gpt.py: error: rank 0 ..."), one line lost."""
    import io
    import sys

    from megatron_ds.errors import print_error
    writes = []

    class Unbuffered(io.StringIO):
        def write(self, text):
            writes.append(text)
            return len(text)
    monkeypatch.setattr(sys, "stderr", Unbuffered())
    print_error("rank 2: all_reduce failed")
    assert writes == ["pretrain_gpt.py: error: rank 2: all_reduce failed\n"]


def _torchrun_layout(tmp_path, monkeypatch, rank):
    """torchrun's error files, .../attempt_0/LOCAL_RANK/error.json, with this process as local rank `rank`."""
    for r in (0, rank):
        (tmp_path / "attempt_0" / str(r)).mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "attempt_0" / str(rank) / "error.json"))
    monkeypatch.setenv("LOCAL_RANK", str(rank))
    monkeypatch.delenv("GROUP_RANK", raising=False)
    return tmp_path / "attempt_0" / "0" / "error.json"


def test_another_rank_waits_for_rank_0s_line(tmp_path, monkeypatch, capsys):
    """torchrun stops every rank at the first exit: a rank faster than rank 0 left the line to torchrun's failure
    table alone. It now exits once rank 0 has printed and recorded (its error file there), silently."""
    import threading
    import time

    from megatron_ds import errors
    first = _torchrun_layout(tmp_path, monkeypatch, 1)
    threading.Timer(0.3, first.write_text, ["{}"]).start()
    start = time.monotonic()
    errors.report_stop("pretrain_gpt.py: error: --moe-router-topk (3) must be between 1 and --num-experts (2)", 1)
    assert 0.25 < time.monotonic() - start < errors.FIRST_LINE_WAIT_S
    assert capsys.readouterr().err == ""
    assert json.loads((tmp_path / "attempt_0" / "1" / "error.json").read_text())["message"]["message"] == (
        "pretrain_gpt.py: error: --moe-router-topk (3) must be between 1 and --num-experts (2)")


def test_a_rank_whose_rank_0_reported_nothing_prints_its_own_line(tmp_path, monkeypatch, capsys):
    from megatron_ds import errors
    _torchrun_layout(tmp_path, monkeypatch, 3)
    monkeypatch.setattr(errors, "FIRST_LINE_WAIT_S", 0.1)
    errors.report_stop("pretrain_gpt.py: error: rank 3's own", 3)
    assert capsys.readouterr().err == "pretrain_gpt.py: error: rank 3's own\n"


def test_rank_0_prints_before_it_records(tmp_path, monkeypatch, capsys):
    """The others stop waiting when rank 0's file appears; torchrun may then stop rank 0: its line is out first."""
    from megatron_ds import errors
    first = _torchrun_layout(tmp_path, monkeypatch, 0)
    seen = []
    monkeypatch.setattr(errors, "record_for_launcher", lambda text: seen.append(capsys.readouterr().err))
    errors.report_stop("pretrain_gpt.py: error: x", 0)
    assert seen == ["pretrain_gpt.py: error: x\n"] and not first.exists()
