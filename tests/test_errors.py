"""Every bad-input error is a UserError: the entry points catch that one type and exit with 2."""
import importlib

import pytest

from megatron_ds.errors import UserError

ERRORS = [("megatron_ds.training.config.arguments", "ArgumentsError"), ("megatron_ds.pipe.config", "ConfigError"),
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
