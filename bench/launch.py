"""Run a function on N gloo ranks of this machine (spawned processes) and return rank 0's result.

For benchmarks that need one launch per pipeline size: every rank gets the usual
torch.distributed environment (MASTER_ADDR/PORT, RANK, LOCAL_RANK, WORLD_SIZE) and
OMP_NUM_THREADS=1; their stdout is dropped. A rank that raises fails the launch with every
rank's traceback; a launch that outlives `timeout` is killed.
"""
from __future__ import annotations

import io
import multiprocessing as mp
import os
import signal
import socket
import sys
import time
import traceback


def _entry(rank, world, port, fn, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    sys.stdout = io.StringIO()  # the parent prints the results; ranks report progress on stderr
    try:
        queue.put((rank, True, fn(*args)))
    except BaseException:  # noqa: BLE001 - reported by the parent
        queue.put((rank, False, traceback.format_exc()))


def _exit(signum, frame):
    raise SystemExit(128 + signum)


def launch(world: int, fn, *args, timeout: float = 3600.0):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, queue), daemon=True) for r in range(world)]
    deadline, got, result, errors = time.monotonic() + timeout, 0, None, []
    previous = signal.signal(signal.SIGTERM, _exit)  # so that the ranks die with us
    try:
        for proc in procs:
            proc.start()
        while got < world and time.monotonic() < deadline:
            if queue.empty():
                if any(proc.exitcode not in (None, 0) for proc in procs):
                    time.sleep(1.0)
                    if queue.empty():
                        errors.append(f"a rank died without a report (exit codes {[p.exitcode for p in procs]})")
                        break
                time.sleep(0.2)
                continue
            rank, ok, value = queue.get()
            got += 1
            if not ok:
                errors.append(f"rank {rank}:\n{value}")
                deadline = min(deadline, time.monotonic() + 20)  # its peers may wait forever
            elif rank == 0:
                result = value
    finally:
        for proc in procs:
            if proc.pid is None:  # never started
                continue
            proc.join(timeout=5 if got == world else 0)
            if proc.is_alive():
                proc.kill()
        signal.signal(signal.SIGTERM, previous)
    if errors or got < world:
        raise RuntimeError("\n".join(errors) or f"{world} ranks: no result within {timeout:.0f} s")
    return result
