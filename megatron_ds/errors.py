"""One base for every error that bad input causes (a flag, a config, a file on disk).

The entry points (pretrain_gpt.py, the preprocessing tools, the schedule CLI) catch
UserError alone: they print its message, which says what is wrong and why, and exit
with `exit_code`, before anything is written half-way. Any other exception is a bug
and keeps its traceback. Pure Python: schedules/ imports it and stays torch-free.
"""
import json
import os
import sys
import time


class UserError(Exception):
    exit_code = 2


def print_error(text):
    """`pretrain_gpt.py: error: <text>` on stderr in one write. Under `python -u` (PYTHONUNBUFFERED, as
    SLURM scripts run) print() writes a line and its newline apart, and the lines of several ranks
    sharing one pipe then run together."""
    sys.stderr.write(f"pretrain_gpt.py: error: {text}\n")
    sys.stderr.flush()


def record_for_launcher(text):
    """Write `text` as this rank's root cause in torchrun's error file (TORCHELASTIC_ERROR_FILE, the JSON of
    torch.distributed.elastic's @record), when torchrun set one. torchrun then ends its report with this
    line instead of "To enable traceback see ...": the cause is the last thing a start-up error prints."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with open(path, "w") as fh:
            json.dump({"message": {"message": text, "extraInfo": {"timestamp": str(int(time.time()))}}}, fh)
