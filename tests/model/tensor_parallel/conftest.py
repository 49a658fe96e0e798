"""One launch per world size, shared by every multi-rank test of the package (ranks.run_all)."""
import pytest

from megatron_ds.testing.launcher import run_ranks

from .ranks import run_all


@pytest.fixture(scope="session")
def tp_results():
    cache = {}

    def get(world):
        if world not in cache:
            cache[world] = run_ranks(world, run_all, world, timeout=600)
        return cache[world]
    return get
