"""tests/conftest.py's `dist` marker: what launches processes is found through helpers, fixtures and local
imports; what does not stays in the fast lane (`pytest -m "not dist"`)."""
import json

from megatron_ds.testing.launcher import run_ranks
from tests.conftest import Launches
from tests.gpt_harness import assert_schedules_match_reference, tiny_config


def _one_rank():
    return 1


def _through_the_launcher():
    return run_ranks(1, _one_rank)


def _through_a_helper():
    return _through_the_launcher()


def _through_a_local_import():
    import subprocess
    return subprocess.run


def _through_the_harness():
    assert_schedules_match_reference(2, 2, 2, 4, [None])


def _in_process():
    return json.dumps(tiny_config().num_layers) + str(_one_rank())


def _recursive(n):
    return _recursive(n - 1) if n else _in_process()


class _Helper:
    def run(self):
        return _through_a_helper()


# in dicts, not named by the test: a test that names a launching function is marked dist itself
LAUNCHING = {"launcher": _through_the_launcher, "helper": _through_a_helper, "local import": _through_a_local_import,
             "harness": _through_the_harness, "class": _Helper}
IN_PROCESS = {"plain": _one_rank, "harness": tiny_config, "calls": _in_process, "recursive": _recursive}


def test_launching_is_found_through_helpers_local_imports_and_classes():
    launches = Launches()
    assert [name for name, fn in LAUNCHING.items() if not launches(fn)] == []
    assert [name for name, fn in IN_PROCESS.items() if launches(fn)] == []
