"""The training layer's bad-input errors, in a module of their own: the flag checks (arguments.py and
the modules it calls) and the checkpoint code (checkpoint/save_load.py, checkpoint/manifest.py, the conversion tools)
raise them without importing the modules that orchestrate them."""
from megatron_ds.errors import UserError


class ArgumentsError(UserError, ValueError):
    """A flag, or a flag/ds_config pair, that cannot work. The message says which and why."""


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be loaded into this run; the message says why and what to do."""
