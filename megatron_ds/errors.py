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


FIRST_LINE_WAIT_S = 5.0  # how long another rank waits for rank 0's line before it prints its own


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


def report_stop(text, rank):
    """The line(s) `text` of an error that stops every rank ("pretrain_gpt.py: error: ..."), once: rank 0 prints
    them, then records them for torchrun. torchrun stops every rank at the first exit, so another rank that
    failed first left the line to its failure table alone (its rank 0 killed before printing, the cause ~55 lines
    down): under torchrun, on rank 0's node, another rank records its own line and then waits until rank 0 has
    recorded (at most FIRST_LINE_WAIT_S); if rank 0 did not, the line was this rank's alone and it prints it."""
    if rank == 0:
        sys.stderr.write(text if text.endswith("\n") else text + "\n")  # one write: see print_error
        sys.stderr.flush()
        record_for_launcher(text.rstrip("\n"))
        return
    record_for_launcher(text.rstrip("\n"))
    first = _first_rank_error_file()
    if first is None:
        return
    deadline = time.monotonic() + FIRST_LINE_WAIT_S
    while time.monotonic() < deadline:
        if os.path.exists(first):
            return
        time.sleep(0.02)
    sys.stderr.write(text if text.endswith("\n") else text + "\n")
    sys.stderr.flush()


def _first_rank_error_file():
    """Rank 0's torchrun error file, when this rank shares its node (torchrun's layout: .../attempt_N/LOCAL_RANK/
    error.json); None otherwise (no torchrun, another node, a layout not torchrun's)."""
    path, local = os.environ.get("TORCHELASTIC_ERROR_FILE"), os.environ.get("LOCAL_RANK")
    if not path or local is None or os.environ.get("GROUP_RANK", "0") != "0":
        return None
    rank_dir = os.path.dirname(path)
    if os.path.basename(rank_dir) != local:
        return None
    return os.path.join(os.path.dirname(rank_dir), "0", os.path.basename(path))
