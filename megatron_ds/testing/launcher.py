"""Run a function on N gloo ranks of this machine, in fresh processes; return every rank's result.

On a machine without CUDA the ranks are forked from a multiprocessing fork server that imported
torch, DeepSpeed and the pipeline package once per calling process: a spawned rank spends ~5 s of CPU
on those imports, which on a 2-core machine was most of a test launch. Each rank still starts from
that clean, just-imported state, with the caller's environment, working directory and stdout/stderr
of the moment. With CUDA the ranks are spawned (DeepSpeed's accelerator probe initialises the CUDA
driver at import, and a child forked after that cannot use the GPU). `startup_env` spawns them too, each a fresh
interpreter with those variables in its environment from the start: what a process reads once as it starts
(glibc's MALLOC_MMAP_THRESHOLD_, which a memory benchmark sets so that freed tensors leave the RSS) cannot be
changed in a forked one.

Each rank gets the torch.distributed environment of a launcher (MASTER_ADDR/PORT, RANK,
LOCAL_RANK, WORLD_SIZE) and one thread. A rank that raises fails the launch with its
traceback; a launch that outlives `timeout` is killed (a hang is a failure, never a stuck
test or benchmark). SIGINT or SIGTERM to the parent stops its ranks (SIGTERM, then SIGKILL
after a few seconds) and then the parent: SIGINT raises KeyboardInterrupt, SIGTERM goes on to
the handler it had before (by default the process ends), so no further launch starts.
"""
from __future__ import annotations

import contextlib
import io
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
import traceback

from megatron_ds.training.initialize import free_port


def _entry(rank, world_size, port, fn, args, kwargs, queue, env, quiet, stdio=None):
    if stdio is not None:  # forked from the server: take the caller's environment and output of now
        os.environ.clear()
        os.environ.update(stdio.environ)
        for target, fd in ((1, stdio.stdout), (2, stdio.stderr)):
            os.dup2(fd.detach(), target)
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    if quiet:
        sys.stdout = io.StringIO()  # the parent prints the results; ranks report progress on stderr
    import torch
    torch.set_num_threads(1)
    try:
        buf = io.BytesIO()
        torch.save(fn(*args, **kwargs), buf)  # bytes, not shared-memory tensors that die with this process
        queue.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - the parent reports it
        queue.put((rank, False, traceback.format_exc()))


class _Signals:
    """SIGINT and SIGTERM noted, not raised, while ranks run: the launch loop checks between steps,
    so a signal never leaves a rank half-started or unowned. restore() puts the previous handlers back."""

    def __init__(self):
        self.received, self.previous = None, {}
        if threading.current_thread() is threading.main_thread():  # only there can Python set handlers
            for signum in (signal.SIGINT, signal.SIGTERM):
                if signal.getsignal(signum) is not signal.SIG_IGN:  # e.g. SIGINT in a background job
                    self.previous[signum] = signal.signal(signum, self._note)

    def _note(self, signum, frame):
        self.received = self.received or signum

    def check(self):
        if self.received:
            raise _Stopped

    def restore(self):
        for signum, handler in self.previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)  # None: set outside Python

    def pass_on(self, procs):
        """After the ranks are gone: stop this process as the signal would have."""
        name = signal.Signals(self.received).name
        print(f"run_ranks: {name}: stopped rank processes {[p.pid for p in procs if p.pid is not None]}",
              file=sys.stderr, flush=True)
        if self.received == signal.SIGINT:
            raise KeyboardInterrupt
        signal.raise_signal(self.received)  # the previous handler's turn; the default ends the process
        raise SystemExit(f"run_ranks: {name}: exiting")  # it returned


class _Stopped(BaseException):
    """A signal arrived: unwinds the launch loop to the clean-up."""


def _stop(procs, grace):
    """Wait up to `grace` s for the started ranks to exit, SIGTERM the rest, SIGKILL those alive 5 s later."""
    started = [p for p in procs if p.pid is not None]
    _join(started, grace)
    for p in started:
        if p.is_alive():
            p.terminate()
    _join(started, 5)
    for p in started:
        if p.is_alive():
            p.kill()
    _join(started, 5)


def _join(procs, seconds):
    deadline = time.monotonic() + seconds
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))


def _collect(procs, queue, timeout, signals):
    """({rank: result}, [error texts]) as the ranks report, until all did, one died silently or time is up."""
    import torch
    results, errors = {}, []
    deadline = time.monotonic() + timeout
    while len(results) + len(errors) < len(procs) and time.monotonic() < deadline:
        signals.check()
        if queue.empty():
            if any(p.exitcode not in (None, 0) for p in procs):
                time.sleep(1.0)  # a rank died without a report (killed, segfault): drain, then stop
                if queue.empty():
                    break
            time.sleep(0.05)
            continue
        rank, ok, value = queue.get()
        if ok:
            results[rank] = torch.load(io.BytesIO(value), weights_only=False)
        else:
            errors.append(f"rank {rank}:\n{value}")
            deadline = min(deadline, time.monotonic() + 15)  # peers of a failed rank may block forever
    return results, errors


def child_env(root, **extra) -> dict:
    """This process's environment for a child Python that imports the clone at `root`, plus `extra`:
    `root` goes first on PYTHONPATH and what PYTHONPATH held stays after it (a site folder or a
    cluster module may be where torch and DeepSpeed come from)."""
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(root), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    return env


# What every rank imports; the fork server imports it once. Not only pipe.build: a rank's first engine
# imports torch._dynamo (torch.optim's constructors), torch._inductor (DeepSpeed's optimizer check imports
# its Muon, which asks torch.compile's config), DeepSpeed's engines and op builders (init_distributed loads
# its shared-memory op): ~1500 modules, ~5 s of CPU a rank.
_PRELOAD = ["torch", "torch.distributed", "deepspeed", "megatron_ds.pipe.build", "torch._dynamo",
            "torch._inductor.compile_fx", "deepspeed.runtime.pipe.engine", "deepspeed.runtime.zero.stage_1_and_2",
            "deepspeed.runtime.zero.muon.muon_optimizer", "deepspeed.ops.op_builder.all_ops"]
_server = []  # [the context], once started
_server_lock = threading.Lock()  # launches from threads (side-by-side runs) start one server, PYTHONPATH restored


def _context():
    """The fork server's context with the preload imported (started on first use), or spawn's under CUDA."""
    with _server_lock:
        return _started_context()


def _started_context():
    if not _server:
        import torch
        if torch.cuda.is_available():
            return mp.get_context("spawn")
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        from multiprocessing import forkserver
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        before = os.environ.get("PYTHONPATH")
        os.environ.update(child_env(root))  # the server imports megatron_ds from where this one came from
        try:
            forkserver.ensure_running()
        finally:
            os.environ.pop("PYTHONPATH")
            if before is not None:
                os.environ["PYTHONPATH"] = before
        _server.append(ctx)
    return _server[0]


class _Stdio:
    """The caller's environment and its stdout/stderr file descriptors as they are at this launch (under
    pytest, the current test's capture), handed to a forked rank: the fork server holds those of its start."""

    def __init__(self):
        self.environ = dict(os.environ)

    def __reduce__(self):  # called while the rank is being sent to the server, which passes the fds along
        from multiprocessing.reduction import DupFd
        return _stdio, (self.environ, DupFd(1), DupFd(2))


def _stdio(environ, stdout, stderr):
    out = _Stdio.__new__(_Stdio)
    out.environ, out.stdout, out.stderr = environ, stdout, stderr
    return out


@contextlib.contextmanager
def _environment(extra: dict):
    """os.environ with `extra` while inside (what a spawned child starts with), as it was after."""
    before = {name: os.environ.get(name) for name in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def run_ranks(world_size, fn, *args, timeout=300, env=None, startup_env=None, quiet=False, **kwargs):
    """[fn(*args, **kwargs) on rank r for r in range(world_size)]; fn must be importable (as for spawn). `env`:
    set in each rank before fn runs; `startup_env`: each rank spawned with it in its environment from its
    interpreter's start (module docstring)."""
    ctx = mp.get_context("spawn") if startup_env else _context()
    stdio = _Stdio() if ctx.get_start_method() == "forkserver" else None
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, kwargs, queue, env or {}, quiet, stdio),
                         daemon=True) for r in range(world_size)]
    results, errors = {}, []
    signals = _Signals()
    try:
        with _environment({k: str(v) for k, v in (startup_env or {}).items()}):
            for p in procs:
                signals.check()
                p.start()
        results, errors = _collect(procs, queue, timeout, signals)
    except _Stopped:
        pass
    finally:
        _stop(procs, grace=5 if len(results) == world_size else 0)
        signals.restore()
    if signals.received:
        signals.pass_on(procs)
    if errors:
        raise RuntimeError("\n".join(errors))
    if len(results) < world_size:
        missing = sorted(set(range(world_size)) - set(results))
        raise RuntimeError(f"ranks {missing} gave no result within {timeout}s "
                           f"(exit codes {[p.exitcode for p in procs]})")
    return [results[r] for r in range(world_size)]


class ForkedScript:
    """`python SCRIPT ARGV...` in a process forked from the fork server (torch, DeepSpeed and the package imported
    once, _PRELOAD) instead of a fresh interpreter, with Popen's face (pid, poll, wait, returncode): its own
    session (as Popen's start_new_session), exactly `env` as its environment, `cwd`, stdout and stderr appended
    unbuffered to `log_path`, `sys.argv` as the interpreter would set it, and the script's
    exit code (-N: killed by signal N). A fresh interpreter spends ~4 s of CPU importing before the script's
    first line; a fork server's child starts from that state, as run_ranks' ranks do. Only what the script's
    interpreter does before its first line (and imports reading the environment then) is not what a spawned
    one does: a test of the command's start-up itself spawns it. Without a fork server (CUDA) it spawns."""

    def __init__(self, script, argv, env, cwd, log_path):
        ctx = _context()
        if ctx.get_start_method() != "forkserver":
            with open(log_path, "a") as log:
                self._popen = subprocess.Popen([sys.executable, script, *argv], cwd=cwd, env=env, stdout=log,
                                               stderr=subprocess.STDOUT, start_new_session=True)
            self.pid = self._popen.pid
            return
        self._popen = None
        self._proc = ctx.Process(target=_run_script, args=(script, list(argv), dict(env), cwd, log_path))
        self._proc.start()
        self.pid = self._proc.pid

    @property
    def returncode(self):
        return self._popen.returncode if self._popen else self._proc.exitcode

    def poll(self):
        return self._popen.poll() if self._popen else self._proc.exitcode

    def wait(self, timeout=None):
        if self._popen:
            return self._popen.wait(timeout)
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(self.pid, timeout)
        return self._proc.exitcode


def _run_script(script, argv, env, cwd, log_path):
    import runpy
    os.setsid()
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    for target in (1, 2):
        os.dup2(fd, target)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):  # the server's objects, which its imports' logging handlers hold too
        stream.reconfigure(line_buffering=True, write_through=True)  # a test reads the log of a run in progress
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = [script, *argv]  # sys.path stays the server's (the package importable): the scripts import no sibling
    runpy.run_path(script, run_name="__main__")


def launches_by_world(fn, timeout=300):
    """get(world) -> run_ranks(world, fn, world): one launch per world size, kept for every later call (a test
    module's fixture shares a launch of all its cases between the tests that read them)."""
    cache = {}

    def get(world):
        if world not in cache:
            cache[world] = run_ranks(world, fn, world, timeout=timeout)
        return cache[world]
    return get
