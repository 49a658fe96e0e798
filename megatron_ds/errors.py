"""One base for every error that bad input causes (a flag, a config, a file on disk).

The entry points (pretrain_gpt.py, the preprocessing tools, the schedule CLI) catch
UserError alone: they print its message, which says what is wrong and why, and exit
with `exit_code`, before anything is written half-way. Any other exception is a bug
and keeps its traceback. Pure Python: schedules/ imports it and stays torch-free.
"""


class UserError(Exception):
    exit_code = 2
