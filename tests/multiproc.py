"""The launcher lives in megatron_ds.testing.launcher; this module keeps the old import path working
for tests written against it (other branches)."""
from megatron_ds.testing.launcher import run_ranks  # noqa: F401
from megatron_ds.training.initialize import free_port as _free_port  # noqa: F401
