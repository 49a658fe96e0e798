"""Conversion of checkpoints (not the checkpoint policy: training/checkpoint/save_load.py): a megatron_ds (DeepSpeed
pipeline) checkpoint <-> a Hugging Face folder, and the single-process reference model loaded from a
checkpoint (generation, evaluation).

The tools in tools/ are argparse shells over these modules. Bad input raises ToolError,
whose message names the file or key and the rule; the shells print it and exit with 2.
"""
from megatron_ds.errors import UserError


class ToolError(UserError, ValueError):
    """Input a checkpoint tool cannot use; the message says which file or key and why."""
