"""Run a function on N gloo ranks of this machine, in fresh (spawned) processes; return every rank's result.

Each rank gets the torch.distributed environment of a launcher (MASTER_ADDR/PORT, RANK,
LOCAL_RANK, WORLD_SIZE) and one thread. A rank that raises fails the launch with its
traceback; a launch that outlives `timeout` is killed (a hang is a failure, never a stuck
test or benchmark), and so are the ranks when the parent gets SIGTERM.
"""
from __future__ import annotations

import io
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback

from megatron_ds.training.initialize import free_port


def _entry(rank, world_size, port, fn, args, kwargs, queue, env, quiet):
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


def _exit(signum, frame):
    raise SystemExit(128 + signum)


def run_ranks(world_size, fn, *args, timeout=300, env=None, quiet=False, **kwargs):
    """[fn(*args, **kwargs) on rank r for r in range(world_size)]; fn must be importable (spawn)."""
    import torch
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, kwargs, queue, env or {}, quiet),
                         daemon=True) for r in range(world_size)]
    results, errors = {}, []
    previous = signal.signal(signal.SIGTERM, _exit)  # so that the ranks die with us
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while len(results) + len(errors) < world_size and time.monotonic() < deadline:
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
    finally:
        for p in procs:
            if p.pid is not None:
                p.join(timeout=5 if len(results) == world_size else 0)
                if p.is_alive():
                    p.kill()
        signal.signal(signal.SIGTERM, previous)
    if errors:
        raise RuntimeError("\n".join(errors))
    if len(results) < world_size:
        missing = sorted(set(range(world_size)) - set(results))
        raise RuntimeError(f"ranks {missing} gave no result within {timeout}s "
                           f"(exit codes {[p.exitcode for p in procs]})")
    return [results[r] for r in range(world_size)]
