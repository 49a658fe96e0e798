"""timeouts.install: a group made later by new_group(ranks) alone carries the timeout, and a call that times
out raises one CollectiveError naming the call, the peer and the group (3 gloo ranks, a 4-second timeout)."""
import datetime
import re
import time

from megatron_ds.testing.launcher import child_env, run_ranks


def _absent_peer():
    import torch
    import torch.distributed as dist
    from megatron_ds.training.faults import timeouts
    timeouts.install(datetime.timedelta(seconds=4))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=4))
    rank = dist.get_rank()
    pair = dist.new_group([0, 1])  # as DeepSpeed makes its groups: no timeout given
    timeouts._state["labels"][pair] = "data-parallel"
    dist.barrier()
    seen = {}
    if rank == 0:  # rank 1 never joins: it stands for a frozen peer
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(2), group=pair)
        except timeouts.CollectiveError as e:
            seen["all_reduce"] = (str(e), time.monotonic() - start)
    if rank == 2:
        start = time.monotonic()
        work = dist.irecv(torch.empty(2), 1)
        try:
            work.wait()
        except timeouts.CollectiveError as e:
            seen["irecv"] = (str(e), time.monotonic() - start)
    time.sleep(1 if rank != 1 else 10)  # let the others time out before rank 1 leaves
    return seen


def test_later_groups_time_out_and_name_the_call():
    results = run_ranks(3, _absent_peer, timeout=300)
    message, waited = results[0]["all_reduce"]
    assert 3.5 < waited < 15, waited  # torch's default for such a group would be 30 minutes
    assert message.startswith("all_reduce on the data-parallel group ranks [0, 1] failed after"), message
    assert "Timed out waiting 4000ms" in message and "\n" not in message
    message, waited = results[2]["irecv"]
    assert 3.5 < waited < 15, waited
    assert message.startswith("irecv from rank 1 on the world group ranks [0, 1, 2] failed after"), message
    assert results[1] == {}


WATCHDOG = """
import datetime, time
from megatron_ds.training.faults import timeouts
timeouts.install(datetime.timedelta(seconds=2), grace=1.0)
stuck = timeouts._wrap("all_reduce", lambda tensor, group=None: time.sleep(60))  # a wait no backend bounds
stuck(None)
"""


def test_watchdog_ends_a_call_the_backend_never_times_out():
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", WATCHDOG], capture_output=True, text=True, timeout=120,
                          env=child_env(root, RANK="5"))
    assert proc.returncode == 1 and time.monotonic() - start < 100  # not the 60 s of the stuck call
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr
    waited = re.match(r"pretrain_gpt.py: error: rank 5: all_reduce on the world group still waiting after (\d+) s, "
                      r"past --distributed-timeout-minutes 0.0333333 \(watchdog\): a peer is frozen$", proc.stderr.strip())
    assert waited and 3 <= int(waited.group(1)) <= 6, proc.stderr


def _batched_ring():
    import torch
    import torch.distributed as dist
    from megatron_ds.training.faults import timeouts
    timeouts.install(datetime.timedelta(seconds=60))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    received = torch.empty(2)
    ops = [dist.P2POp(dist.isend, torch.full((2,), float(rank)), (rank + 1) % world),
           dist.P2POp(dist.irecv, received, (rank - 1) % world)]
    works = dist.batch_isend_irecv(ops)
    for work in works:
        work.wait()
    return received.tolist(), type(works[0]).__name__


def test_batched_p2p_takes_the_wrapped_send_and_receive():
    """torch's P2POp accepts only its own isend/irecv: with them wrapped (context parallelism's ring attention
    batches its K/V exchange) it is handed the functions they wrap; the batch's Works are wrapped as any call's."""
    results = run_ranks(3, _batched_ring, timeout=300)
    assert [r[0] for r in results] == [[2.0, 2.0], [0.0, 0.0], [1.0, 1.0]]
    assert {r[1] for r in results} == {"_Work"}
