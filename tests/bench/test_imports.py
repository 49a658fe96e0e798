"""Every bench module imports (benches are run by hand, not by tests: a moved helper would break one unseen)."""
import importlib
import pathlib

import pytest

BENCHES = sorted(p.stem for p in (pathlib.Path(__file__).parents[2] / "bench").glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("name", BENCHES)
def test_bench_module_imports_and_has_main(name):
    module = importlib.import_module(f"bench.{name}")
    assert callable(getattr(module, "main", None)) or name in ("engines", "options", "ds_replay", "moe_costs", "harness"), name
