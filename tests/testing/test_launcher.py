"""run_ranks (megatron_ds/testing/launcher.py) under SIGTERM and SIGINT: a caller that would launch
again and again stops at once, its rank processes gone, the previous handlers back in place.
The two cases run side by side (rank start-up is most of the time)."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from megatron_ds.testing.launcher import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    from megatron_ds.testing.launcher import run_ranks

    def sleeper(folder):
        open(os.path.join(folder, str(os.getpid())), "w").close()
        time.sleep(600)

    if __name__ == "__main__":
        # as a foreground shell starts it: pytest run in the background (`cmd &` in a script) hands its
        # children SIGINT ignored, which run_ranks then rightly leaves ignored
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            for i in range(3):
                try:
                    run_ranks(2, sleeper, sys.argv[1], timeout=600)
                except (Exception, SystemExit) as e:  # as pytest takes a test's SystemExit: that test failed, go on
                    print(f"launch {i} failed ({e!r}), launching again", flush=True)
        except KeyboardInterrupt:
            print("SIGINT handler restored:", signal.getsignal(signal.SIGINT) is signal.default_int_handler)
            raise
""")


def _alive(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()
    except FileNotFoundError:
        return False


def test_sigterm_and_sigint_stop_the_ranks_and_the_caller(tmp_path):
    script = tmp_path / "launch.py"
    script.write_text(SCRIPT)
    procs, folders = {}, {}
    for signum in (signal.SIGTERM, signal.SIGINT):
        folders[signum] = tmp_path / signum.name
        folders[signum].mkdir()
        procs[signum] = subprocess.Popen([sys.executable, str(script), str(folders[signum])], cwd=ROOT, text=True,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         env=child_env(ROOT, OMP_NUM_THREADS="1"))
    ranks, ended = {}, {}
    try:
        deadline = time.monotonic() + 180
        while len(ranks) < 2:
            assert time.monotonic() < deadline, "the ranks did not start"
            for signum, folder in folders.items():
                if signum not in ranks and len(os.listdir(folder)) == 2:
                    ranks[signum] = [int(name) for name in os.listdir(folder)]
                    procs[signum].send_signal(signum)
                    ended[signum] = time.monotonic()
            time.sleep(0.1)
        for signum, proc in procs.items():
            out, err = proc.communicate(timeout=60)
            ended[signum] = (time.monotonic() - ended[signum], out, err)
    finally:
        for proc in procs.values():
            proc.kill()
        for folder in folders.values():  # a failed test leaves no rank behind either
            for pid in map(int, os.listdir(folder)):
                if _alive(pid):
                    os.kill(pid, signal.SIGKILL)
    for signum, (took, out, err) in ended.items():
        assert took < 20, (signum, took)  # a sleeping rank ends at SIGTERM; no need for the SIGKILL 5 s later
        assert [pid for pid in ranks[signum] if _alive(pid)] == [], signum
        assert len(os.listdir(folders[signum])) == 2 and "launching again" not in out, out  # no further launch
        assert f"run_ranks: {signum.name}: stopped rank processes" in err, err
    # SIGTERM: the default handler, restored and passed on, ends the process as SIGTERM does
    assert procs[signal.SIGTERM].returncode == -signal.SIGTERM, ended[signal.SIGTERM][2]
    # SIGINT: KeyboardInterrupt, which ends Python with SIGINT
    took, out, err = ended[signal.SIGINT]
    assert "SIGINT handler restored: True" in out and err.rstrip().endswith("KeyboardInterrupt"), (out, err)
    assert procs[signal.SIGINT].returncode == -signal.SIGINT, err


def test_child_env_puts_the_clone_first_and_keeps_pythonpath(tmp_path, monkeypatch):
    """Where the dependencies come through PYTHONPATH (a site folder, a cluster module), a launched test
    still finds them: the clone is prepended, not put in their place."""
    deps = tmp_path / "deps"
    deps.mkdir()
    (deps / "cluster_module.py").write_text("NAME = 'from PYTHONPATH'\n")
    monkeypatch.setenv("PYTHONPATH", str(deps))
    env = child_env(ROOT, OMP_NUM_THREADS="1")
    assert env["PYTHONPATH"] == os.pathsep.join([ROOT, str(deps)]) and env["OMP_NUM_THREADS"] == "1"
    proc = subprocess.run([sys.executable, "-c", "import cluster_module, megatron_ds.testing as t; "
                           "print(cluster_module.NAME, t.__file__)"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["from", "PYTHONPATH", os.path.join(ROOT, "megatron_ds", "testing", "__init__.py")]
    monkeypatch.delenv("PYTHONPATH")
    assert child_env(ROOT)["PYTHONPATH"] == ROOT


def _report(word):
    print("out:" + word, flush=True)
    print("err:" + word, file=sys.stderr, flush=True)
    return os.environ.get("LAUNCHER_PROBE"), os.getcwd(), os.environ["RANK"]


@pytest.fixture(scope="module")
def started_server():
    """The fork server started before any test's own capture exists (as in the suite, by an earlier test)."""
    from megatron_ds.testing import launcher
    launcher._context()


def test_ranks_see_the_callers_environment_folder_and_output_of_each_launch(started_server, tmp_path, monkeypatch,
                                                                            capfd):
    """Ranks forked from the fork server still get what a spawned rank gets: the caller's environment and
    working folder at this launch, and its stdout/stderr (here this test's capfd), not those the server
    started with."""
    from megatron_ds.testing.launcher import run_ranks
    for word, folder in (("first", tmp_path), ("second", ROOT)):
        monkeypatch.setenv("LAUNCHER_PROBE", word)
        monkeypatch.chdir(folder)
        assert run_ranks(2, _report, word) == [(word, str(folder), "0"), (word, str(folder), "1")]
        out, err = capfd.readouterr()
        assert out.count("out:" + word) == 2 and err.count("err:" + word) == 2, (out, err)


def _started_with():
    """This process's environment as its interpreter started (the kernel's copy of exec's), and as it is now."""
    with open("/proc/self/environ", "rb") as f:
        at_start = dict(entry.decode().split("=", 1) for entry in f.read().split(b"\0") if b"=" in entry)
    return at_start.get("LAUNCHER_STARTUP"), os.environ.get("LAUNCHER_STARTUP"), os.environ.get("LAUNCHER_ENV")


def test_startup_env_is_in_each_ranks_environment_from_its_start(started_server, monkeypatch):
    """A variable read once at a process's start (glibc's MALLOC_MMAP_THRESHOLD_) reaches a spawned rank's exec,
    where a rank forked from the fork server only gets it set afterwards; the caller's environment is left as
    it was."""
    from megatron_ds.testing.launcher import run_ranks
    monkeypatch.delenv("LAUNCHER_STARTUP", raising=False)
    spawned = run_ranks(2, _started_with, startup_env={"LAUNCHER_STARTUP": 65536}, env={"LAUNCHER_ENV": "e"})
    assert spawned == [("65536", "65536", "e")] * 2
    assert "LAUNCHER_STARTUP" not in os.environ
    forked = run_ranks(2, _started_with, env={"LAUNCHER_STARTUP": "65536"})  # too late for a start-up reader
    assert forked == [(None, "65536", None)] * 2


PROBE = textwrap.dedent("""
    import json, os, sys, time
    print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "env": sorted(os.environ), "probe": os.environ["PROBE"],
                      "own_session": os.getsid(0) == os.getpid()}))
    print("started", file=sys.stderr)  # no flush: line-buffered, as PYTHONUNBUFFERED gives a spawned script
    if sys.argv[1] == "wait":
        time.sleep(600)
    sys.exit(int(sys.argv[1]))
""")


def test_a_script_forked_from_the_server_starts_and_ends_as_a_spawned_one(started_server, tmp_path):
    """ForkedScript (fault_injection's Job(fork=True)): the script's argv, working folder, exactly
    the given environment, its own session, its output in the log while it runs, its exit code; killed: -9."""
    import json
    from megatron_ds.testing.launcher import ForkedScript
    script, env = tmp_path / "probe.py", {"PROBE": "forked", "PATH": os.environ.get("PATH", "")}
    script.write_text(PROBE)
    done = ForkedScript(str(script), ["3"], env, str(tmp_path), str(tmp_path / "done.log"))
    assert done.wait(120) == 3 and done.poll() == 3 and done.returncode == 3
    lines = (tmp_path / "done.log").read_text().splitlines()
    assert json.loads(lines[0]) == {"argv": [str(script), "3"], "cwd": str(tmp_path), "env": ["PATH", "PROBE"],
                                    "probe": "forked", "own_session": True}
    assert lines[1:] == ["started"]
    (tmp_path / "waiting.log").touch()  # as Job opens its log first
    waiting = ForkedScript(str(script), ["wait"], env, str(tmp_path), str(tmp_path / "waiting.log"))
    deadline = time.monotonic() + 120
    while "started" not in (tmp_path / "waiting.log").read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "started" in (tmp_path / "waiting.log").read_text()
    with pytest.raises(subprocess.TimeoutExpired):
        waiting.wait(0.1)
    assert waiting.poll() is None
    os.killpg(waiting.pid, signal.SIGKILL)
    assert waiting.wait(60) == -signal.SIGKILL
