"""Corpus preprocessing: JSON lines (or a Hugging Face dataset) -> Megatron .bin/.idx.

The tools in tools/ are thin wrappers over these modules.
"""
from megatron_ds.errors import UserError


class PreprocessError(UserError, ValueError):
    """Bad input or flags for preprocessing; the message names what and why."""
