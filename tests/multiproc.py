"""Run a function on N gloo ranks in fresh processes; return every rank's result.

A rank that raises fails the whole run with its traceback; a run that outlives
`timeout` is killed (a hang is a failure, never a stuck CI).
"""
import io
import os
import socket
import time
import traceback

import torch.multiprocessing as mp


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, fn, args, kwargs, queue, env):
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    import torch
    torch.set_num_threads(1)
    try:
        buf = io.BytesIO()
        torch.save(fn(*args, **kwargs), buf)  # bytes, not shared-memory tensors that die with this process
        queue.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - the parent reports it
        queue.put((rank, False, traceback.format_exc()))


def run_ranks(world_size, fn, *args, timeout=300, env=None, **kwargs):
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, kwargs, queue, env or {}), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, []
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
            import torch
            results[rank] = torch.load(io.BytesIO(value), weights_only=False)
        else:
            errors.append(f"rank {rank}:\n{value}")
            deadline = min(deadline, time.monotonic() + 15)  # peers of a failed rank may block forever
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    if len(results) < world_size:
        missing = sorted(set(range(world_size)) - set(results))
        raise AssertionError(f"ranks {missing} gave no result within {timeout}s "
                             f"(exit codes {[p.exitcode for p in procs]})")
    return [results[r] for r in range(world_size)]
