"""The benchmarks' launch: megatron_ds.testing.launcher.run_ranks with the ranks' stdout dropped
(the parent prints the tables), returning rank 0's result."""
from __future__ import annotations

from megatron_ds.testing.launcher import run_ranks


def launch(world: int, fn, *args, timeout: float = 3600.0):
    return run_ranks(world, fn, *args, timeout=timeout, quiet=True)[0]
