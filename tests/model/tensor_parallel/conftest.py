"""One launch per world size, shared by every multi-rank test of the package (ranks.run_all)."""
import pytest

from megatron_ds.testing.launcher import launches_by_world

from .ranks import run_all


@pytest.fixture(scope="session")
def tp_results():
    return launches_by_world(run_all, timeout=600)
