"""DeepSpeed's own pipeline unit tests, run with megatron_ds's engine in place of DeepSpeed's, once per schedule.

    python -m tools.run_deepspeed_pipe_tests                      # every schedule, and DeepSpeed's own engine
    python -m tools.run_deepspeed_pipe_tests 1f1b zbv --json OUT  # some of them, the records kept

DeepSpeed's tests are not in its wheel or its sdist (PyPI's deepspeed-0.19.8.tar.gz holds no tests/), so they are
taken from a DeepSpeed git repository (--git-dir, --ref; the default ref is the installed version's tag when the
repository has it, else `master`) or a checkout (--source), or else from the environment's MEGATRON_DS_DEEPSPEED_SOURCE (either
kind); without one the script says how to get it: a clone of DeepSpeed's repository at the installed version's tag. The files run are TESTS: tests/unit/pipe/,
tests/unit/runtime/pipe/test_pipe.py (its CIFAR-10 tests download the data set: skipped) and
tests/unit/checkpoint/test_pipeline.py. On CPU they run over gloo, each test's processes started by DeepSpeed's
own DistributedTest with LOCAL_SIZE set to the world size (DeepSpeed's CPU accelerator counts its devices by it).

The swap: the extracted tests/unit/common.py, which every one of these test modules imports in the pytest process
and in each rank's process, ends with a call of `swap_engine()`. With MEGATRON_DS_SCHEDULE=NAME in the
environment it puts a wrapper in place of `deepspeed.initialize`: a PipelineModule goes to
`megatron_ds.initialize` with `"pipeline": {"schedule": NAME}` added to the test's ds_config (interleaved: 2
virtual stages), and the engine it returns must be ours; a ds_config the schedule cannot run (too few
micro-batches for its shape, a ZeRO stage it refuses) skips the test with megatron_ds's one-line reason. Each
initialize is recorded (schedule, engine class, rank) in MEGATRON_DS_SWAP_LOG; the pytest plugin of this module
(-p tools.run_deepspeed_pipe_tests) assigns the records written during a test to that test. Without the variable
nothing is swapped: the row "deepspeed" is DeepSpeed's own engine on the same tests.
"""
import argparse
import contextlib
import copy
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCE_VAR = "MEGATRON_DS_DEEPSPEED_SOURCE"  # a DeepSpeed checkout or git repository, when no flag names one
DEEPSPEED_URL = "https://github.com/deepspeedai/DeepSpeed"
TESTS = ["unit/pipe", "unit/runtime/pipe/test_pipe.py", "unit/checkpoint/test_pipeline.py"]
SCHEDULES = ["1f1b", "gpipe", "interleaved", "zb-h1", "zb-h2", "zbv", "zbv-half", "zbv-min", "bitpipe", "dualpipev"]
DOWNLOADS = {"TestPipeCifar10": "downloads CIFAR-10 (train_cifar): excluded, needs the network"}
SWAP_LINE = "\nfrom tools.run_deepspeed_pipe_tests import swap_engine as _swap_engine  # megatron_ds\n_swap_engine()\n"
SCHEDULE_VAR, LOG_VAR = "MEGATRON_DS_SCHEDULE", "MEGATRON_DS_SWAP_LOG"


# -- the swap, in every process of a test -------------------------------------------------------------------------
_inside = threading.local()


def with_schedule(config, schedule):
    """A copy of the ds_config `config` (a dict) whose "pipeline" section names `schedule`."""
    config = copy.deepcopy(config)
    section = config.setdefault("pipeline", {})
    section["schedule"] = schedule
    if schedule == "interleaved":
        section.setdefault("virtual_stages", 2)
    return config


def _record(**fields):
    path = os.environ.get(LOG_VAR)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(fields) + "\n")


def swap_engine():
    """deepspeed.initialize -> megatron_ds.initialize under $MEGATRON_DS_SCHEDULE (nothing without it)."""
    schedule = os.environ.get(SCHEDULE_VAR)
    if not schedule:
        return
    import deepspeed
    import pytest
    from deepspeed.pipe import PipelineModule

    import megatron_ds
    from megatron_ds.errors import UserError
    from megatron_ds.pipe.foreign.foreign_engine import ForeignScheduleEngine
    stock = getattr(deepspeed.initialize, "stock", deepspeed.initialize)

    def initialize(*args, **kwargs):
        model = kwargs.get("model", args[1] if len(args) > 1 else None)
        if getattr(_inside, "active", False) or not isinstance(model, PipelineModule):
            return stock(*args, **kwargs)  # megatron_ds.initialize's own call of DeepSpeed, or not a pipeline
        config = kwargs.pop("config", None)
        if config is None:
            config = kwargs.pop("config_params", None)
        if not isinstance(config, dict):
            raise TypeError(f"the swap takes the ds_config as a dict, got {type(config).__name__}")
        _inside.active = True
        try:
            result = megatron_ds.initialize(*args, config=with_schedule(config, schedule), **kwargs)
        except UserError as exc:
            _record(schedule=schedule, engine=None, refused=str(exc), rank=int(os.environ.get("RANK", 0)))
            pytest.skip(f"{schedule}: {exc}")
        finally:
            _inside.active = False
        engine = result[0]
        if not isinstance(engine, ForeignScheduleEngine):
            raise AssertionError(f"megatron_ds.initialize returned a {type(engine).__name__}")
        _record(schedule=schedule, engine=type(engine).__name__, rank=int(os.environ.get("RANK", 0)))
        return result

    initialize.stock = stock
    deepspeed.initialize = initialize


# -- the pytest plugin, in the pytest process ---------------------------------------------------------------------
_results = {}


def pytest_collection_modifyitems(items):
    import pytest
    from deepspeed.accelerator import get_accelerator
    fp16 = get_accelerator().is_fp16_supported()
    for item in items:
        if item.cls is not None and item.cls.__name__ in DOWNLOADS:
            item.add_marker(pytest.mark.skip(reason=DOWNLOADS[item.cls.__name__]))
        params = getattr(getattr(item, "callspec", None), "params", {})
        if item.name.startswith("test_checkpoint_pipe_engine") and params.get("zero_stage") and not fp16:
            # the test turns fp16 on with ZeRO; DeepSpeed's own engine stops the same way on this accelerator
            item.add_marker(pytest.mark.skip(reason=f"fp16 (with ZeRO-1 in this test): "
                                                    f"{get_accelerator().device_name()} does not support it"))


def _log_lines():
    path = os.environ.get(LOG_VAR)
    if not path or not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def pytest_runtest_logreport(report):
    entry = _results.setdefault(report.nodeid, {"outcome": "passed", "reason": "", "seconds": 0.0})
    entry["seconds"] += report.duration
    if report.outcome == "skipped":
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        entry.update(outcome="skipped", reason=reason.removeprefix("Skipped: "))
    elif report.outcome == "failed":
        crash = getattr(getattr(report.longrepr, "reprcrash", None), "message", None)
        entry.update(outcome="failed", reason=(crash or str(report.longrepr).strip().splitlines()[-1])[:300])
    if report.when == "teardown":
        seen = _log_lines()
        entry["engines"] = sorted({r["engine"] or "refused" for r in seen[entry.pop("log_start", 0):]})


def pytest_runtest_logstart(nodeid, location):
    _results.setdefault(nodeid, {"outcome": "passed", "reason": "", "seconds": 0.0})["log_start"] = len(_log_lines())


def pytest_sessionfinish(session):
    out = os.environ.get("MEGATRON_DS_SWAP_RESULTS")
    if out:
        with open(out, "w") as f:
            json.dump(_results, f, indent=1)


# -- the runner -----------------------------------------------------------------------------------------------------
def installed_version():
    import importlib.metadata
    return importlib.metadata.version("deepspeed")


def extract(git_dir, ref, dest):
    """DeepSpeed's tests/ of `ref` in `git_dir` (a bare repository will do) under `dest`; the ref used."""
    if ref is None:
        tag = f"v{installed_version()}"
        known = subprocess.run(["git", f"--git-dir={git_dir}", "rev-parse", "--verify", "-q", tag],
                               capture_output=True).returncode == 0
        ref = tag if known else "master"
    archive = subprocess.run(["git", f"--git-dir={git_dir}", "archive", ref, "tests"], check=True,
                             capture_output=True).stdout
    with tempfile.TemporaryFile() as f:
        f.write(archive)
        f.seek(0)
        with tarfile.open(fileobj=f) as tar:
            tar.extractall(dest, filter="data")
    version = subprocess.run(["git", f"--git-dir={git_dir}", "show", f"{ref}:version.txt"], capture_output=True,
                             text=True).stdout.strip()
    return f"{ref} (version.txt {version})"


# Lines of older tests that name what the installed DeepSpeed removed: (file, line, the attribute, why), dropped
# only when the installed engine class lacks the attribute (the tests of the installed version cannot name it).
DRIFT = [("unit/checkpoint/common.py",
          "    assert saved_model.sparse_tensor_module_names == loaded_model.sparse_tensor_module_names\n",
          "sparse_tensor_module_names", "DeepSpeedEngine.sparse_tensor_module_names is gone from 0.19.8")]


def prepare(tests_root):
    """The swap's call appended to tests/unit/common.py (once); DRIFT's lines dropped where they apply. Returns
    what was dropped, to be reported."""
    common = pathlib.Path(tests_root) / "unit" / "common.py"
    text = common.read_text()
    if SWAP_LINE not in text:
        common.write_text(text + SWAP_LINE)
    import inspect

    import deepspeed.runtime.engine
    source = inspect.getsource(deepspeed.runtime.engine)
    dropped = []
    for name, line, attribute, why in DRIFT:
        path = pathlib.Path(tests_root) / name
        text = path.read_text()
        if line in text and attribute not in source:
            path.write_text(text.replace(line, ""))
            dropped.append(f"{name}: {line.strip()} ({why})")
    return dropped


def run_schedule(tests_root, schedule, selection, timeout, log_dir=None):
    """One pytest run of `selection` under `schedule` ("deepspeed": no swap): {nodeid: record}; pytest's output
    goes to LOG_DIR/SCHEDULE.log when `log_dir` is given."""
    with tempfile.TemporaryDirectory() as scratch:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                   OMP_NUM_THREADS="1", LOCAL_SIZE="4", DS_DISABLE_REUSE_DIST_ENV="1",
                   MEGATRON_DS_SWAP_RESULTS=os.path.join(scratch, "results.json"),
                   **{LOG_VAR: os.path.join(scratch, "log.jsonl")})
        env.pop(SCHEDULE_VAR, None)
        if schedule != "deepspeed":
            env[SCHEDULE_VAR] = schedule
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "tools.run_deepspeed_pipe_tests", "-p", "no:cacheprovider",
               "-o", "addopts=", "--rootdir", str(tests_root), *selection]
        log = pathlib.Path(log_dir or scratch) / f"{schedule}.log"
        with open(log, "w") as out:
            subprocess.run(cmd, cwd=tests_root, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
        path = pathlib.Path(env["MEGATRON_DS_SWAP_RESULTS"])
        if not path.exists():
            raise RuntimeError(f"pytest under {schedule} wrote no results:\n{log.read_text()[-5000:]}")
        return json.loads(path.read_text())


def table(runs):
    """Markdown: one row per test, one column per schedule (pass / skip / FAIL)."""
    tests = sorted({t for results in runs.values() for t in results})
    names = list(runs)
    short = {"passed": "pass", "skipped": "skip", "failed": "FAIL"}
    lines = ["| test | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for test in tests:
        cells = []
        for name in names:
            r = runs[name].get(test)
            cell = short[r["outcome"]] if r else "-"
            if r and r["outcome"] == "passed" and name != "deepspeed" and "ForeignScheduleEngine" not in r.get(
                    "engines", []):
                cell = "pass (no engine)"
            cells.append(cell)
        lines.append(f"| {test.split('::', 1)[1]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def reasons(runs):
    """Each distinct skip or failure reason, with the schedules and tests it covers."""
    found = {}
    for name, results in runs.items():
        for test, r in results.items():
            if r["outcome"] != "passed":
                found.setdefault((r["outcome"], r["reason"]), []).append(f"{name}: {test.split('::', 1)[1]}")
    return [f"- {outcome} ({len(where)}x) {reason}\n    " + "; ".join(where[:6]) + (" ..." if len(where) > 6 else "")
            for (outcome, reason), where in sorted(found.items())]


class SourceError(Exception):
    """No DeepSpeed source to take the tests from: one line saying how to get it."""


def tests_source(source, git_dir, env=None):
    """("source", CHECKOUT) or ("git", GIT_DIR): where DeepSpeed's tests come from, by --source, --git-dir or the
    environment's SOURCE_VAR (a checkout: a folder holding tests/unit; else a git repository, bare or not)."""
    env = os.environ if env is None else env
    given = ("--source", source) if source else ("--git-dir", git_dir) if git_dir else (SOURCE_VAR, env.get(SOURCE_VAR))
    flag, path = given
    if not path:
        tag = f"v{installed_version()}"
        raise SourceError(f"DeepSpeed's tests are not in its wheel or sdist: give --source CHECKOUT or --git-dir REPO "
                          f"(or set {SOURCE_VAR}), e.g. after git clone --depth 1 --branch {tag} {DEEPSPEED_URL}")
    path = pathlib.Path(path)
    if not path.is_dir():
        raise SourceError(f"{flag} {path}: no such folder (a DeepSpeed checkout or git repository)")
    if flag == "--source" or (flag == SOURCE_VAR and (path / "tests" / "unit").is_dir()):
        if not (path / "tests" / "unit").is_dir():
            raise SourceError(f"{flag} {path}: holds no tests/unit; give a DeepSpeed checkout")
        return "source", path
    git_dir = path / ".git" if (path / ".git").is_dir() else path
    if subprocess.run(["git", f"--git-dir={git_dir}", "rev-parse", "--git-dir"], capture_output=True).returncode:
        raise SourceError(f"{flag} {path}: not a git repository nor a checkout holding tests/unit")
    return "git", git_dir


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("schedules", nargs="*", default=["deepspeed", *SCHEDULES])
    parser.add_argument("--git-dir", default=None, help=f"a DeepSpeed git repository (bare is fine; default: "
                                                        f"${SOURCE_VAR})")
    parser.add_argument("--ref", default=None, help="default: the installed version's tag, else master")
    parser.add_argument("--source", default=None, help="a DeepSpeed checkout (its tests/ used instead of git)")
    parser.add_argument("-k", dest="keyword", default=None, help="pytest -k over the tests")
    parser.add_argument("--json", default=None, help="write every run's records here")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per schedule")
    parser.add_argument("--logs", default=None, help="keep each schedule's pytest output here (SCHEDULE.log)")
    args = parser.parse_args(argv)
    try:
        kind, path = tests_source(args.source, args.git_dir)
    except SourceError as exc:
        sys.stderr.write(f"run_deepspeed_pipe_tests: error: {exc}\n")
        return 2
    with contextlib.ExitStack() as stack:
        work = pathlib.Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ds_pipe_tests_")))
        if kind == "source":
            shutil.copytree(path / "tests", work / "tests")
            origin = str(path)
        else:
            origin = extract(path, args.ref, work)
        tests_root = work / "tests"
        for line in prepare(tests_root):
            print(f"dropped from the tests: {line}", flush=True)
        selection = TESTS + (["-k", args.keyword] if args.keyword else [])
        print(f"DeepSpeed tests from {origin}; installed deepspeed {installed_version()}", flush=True)
        runs = {}
        for schedule in args.schedules:
            start = time.time()
            if args.logs:
                os.makedirs(args.logs, exist_ok=True)
            runs[schedule] = run_schedule(tests_root, schedule, selection, args.timeout, args.logs)
            counts = {o: sum(r["outcome"] == o for r in runs[schedule].values()) for o in ("passed", "skipped", "failed")}
            print(f"{schedule}: {counts} in {time.time() - start:.0f} s", flush=True)
    print(table(runs))
    print("\n".join(reasons(runs)))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"origin": origin, "runs": runs}, indent=1))
    return 1 if any(r["outcome"] == "failed" for name, res in runs.items() for r in res.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
