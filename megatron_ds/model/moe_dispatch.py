"""Expert parallelism: a MoE layer's experts split over an expert-parallel (EP) group of data-parallel ranks.

EP rank r of a group of e holds the experts [r E/e, (r+1) E/e). Each rank routes its own tokens; the
tokens for another rank's experts travel there and back by all-to-all (uneven counts per expert, dropless):
the counts first (E/e per peer), then the token rows, ordered by peer and, within a peer, by expert. The
receiver runs each local expert on the rows all peers sent it, and the results go back the same way.
The all-to-all's backward is the reverse all-to-all, so an expert's weight gradient sums its tokens from
every peer: ZeRO then reduces it over the expert-data-parallel group (the ranks holding the same experts)
and divides by the whole data-parallel size, which makes it the data-parallel mean (DeepSpeed's MoE groups,
`pipe/moe/moe.py` creates them).

The groups sit in DeepSpeed's registry (deepspeed.utils.groups, named "ep_size_<e>"): consecutive
data-parallel ranks of one stage and TP rank form an EP group, and ranks e apart an expert-data-parallel group.

Inside an overlapped unit (pipe/moe/overlap.py: the forward of one micro-batch and the backward of another)
each all-to-all is issued asynchronously and, while it is in flight, `InFlight.meanwhile` runs the unit's other
side until that side issues its own or ends; then this side waits on its handle. Outside a unit (and while
AllToAllTimes times them) the collective blocks as before.

For tests and benchmarks only, the environment variable MEGATRON_DS_TEST_A2A_LATENCY_MS makes every all-to-all
that many milliseconds slower: a stand-in for a slow network, so that CPU runs can show what overlapping the
all-to-all hides. Either way the all-to-all ends that long after its transfer: a blocking one sleeps it after
the collective (inside AllToAllTimes' interval); an issued one notes when its transfer ended (its future's
callback), so its wait sleeps only what the other side's work left of it (`AddedLatency` counts what was slept).
No run setting.
"""
import os
import time

import torch
import torch.distributed as dist

from ..errors import UserError


class ExpertGroupsError(UserError):
    """A MoE layer built with expert parallelism before its process groups exist."""


def group_name(expert_parallel_size: int) -> str:
    return f"ep_size_{expert_parallel_size}"


def expert_parallel_group(m):
    """The EP group of a MoEConfig's layers, None without expert parallelism (the groups must exist)."""
    if m.expert_model_parallel_size == 1:
        return None
    from deepspeed.utils import groups  # lazy: only an expert-parallel model needs DeepSpeed's group registry
    name = group_name(m.expert_model_parallel_size)
    if name not in groups._get_expert_parallel_group_dict():
        raise ExpertGroupsError(
            f"expert parallelism {m.expert_model_parallel_size}: its process groups are not made; a MoE layer keeps "
            "only its rank's experts when built, so make them first (your own PipelineModule: "
            "megatron_ds.pipe.foreign.foreign_moe.expert_parallel_groups(config, num_stages) on every rank)")
    return groups._get_expert_parallel_group(name)


def local_experts(m, group):
    """The global indices of the experts this rank holds."""
    per_rank = m.num_experts // m.expert_model_parallel_size
    start = 0 if group is None else dist.get_rank(group) * per_rank
    return range(start, start + per_rank)


class AllToAllTimes:
    """A timing hook: while `intervals` is a list, every all-to-all of the dispatch (the counts, the rows, forward
    and backward) appends its (start, end) time.perf_counter() seconds to it, the wait for the peers included.
    "auto" (pipe/auto.py) sets it during its timed iterations and charges each interval to the op it ran in:
    the all-to-all is communication inside F and B, which the simulator keeps apart from their compute. On a
    GPU the device is synchronised around each timed one (NCCL returns before the transfer is done)."""
    intervals = None


class InFlight:
    """What runs while an all-to-all is in flight: `meanwhile()`, set by the runtime around an overlapped unit
    (pipe/moe/overlap.py), runs the unit's other side and returns when this side is due again; None: nothing, the
    collective blocks."""
    meanwhile = None


TEST_LATENCY_ENV = "MEGATRON_DS_TEST_A2A_LATENCY_MS"


def added_latency() -> float:
    """Seconds of the test-only latency every all-to-all takes on top of its transfer (0: unset)."""
    text = os.environ.get(TEST_LATENCY_ENV, "").strip()
    try:
        ms = float(text) if text else 0.0
    except ValueError:
        ms = -1.0
    if not ms >= 0:
        raise RuntimeError(f"{TEST_LATENCY_ENV}={text!r}: give milliseconds >= 0 (a test-only latency)")
    return ms / 1e3


class AddedLatency:
    """The test-only latency's account, in seconds summed over this process's all-to-alls: `added` (the latency
    each took on), `slept` (what its waits really slept: all of it when blocking, what was left of it at the wait
    when issued). added - slept is what overlapped work hid."""
    added = 0.0
    slept = 0.0

    @classmethod
    def sleep_until(cls, due: float, latency: float):
        left = due - time.perf_counter()
        cls.added += latency
        if left > 0:
            time.sleep(left)
            cls.slept += left


def _all_to_all(out, x, out_splits=None, in_splits=None, group=None):
    latency = added_latency()
    if InFlight.meanwhile is not None and AllToAllTimes.intervals is None:
        # gloo's asynchronous work on CPU, NCCL's stream on a GPU; the other side runs meanwhile
        work = dist.all_to_all_single(out, x, out_splits, in_splits, group=group, async_op=True)
        done = []
        if latency:  # the latency counts from the transfer's end, as after a blocking one
            work.get_future().add_done_callback(lambda _: done.append(time.perf_counter()))
        InFlight.meanwhile()
        work.wait()
        AddedLatency.sleep_until((done[0] if done else time.perf_counter()) + latency, latency)
        return
    timing = AllToAllTimes.intervals is not None
    sync = torch.cuda.synchronize if timing and x.is_cuda else (lambda: None)
    sync()  # the queued compute is the op's, not the all-to-all's
    start = time.perf_counter()
    dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    sync()
    AddedLatency.sleep_until(time.perf_counter() + latency, latency)
    if timing:
        AllToAllTimes.intervals.append((start, time.perf_counter()))


class _AllToAll(torch.autograd.Function):
    """Rows of x to the peers (in_splits[j] to peer j); returns the rows received (out_splits[j] from j)."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        _all_to_all(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        _all_to_all(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def run_experts_across(rows, counts, experts, local, group):
    """The outputs of the rows this rank routed (sorted by global expert, counts[i] for expert i), computed
    by their experts on whichever EP rank holds them. `experts(counts, rows)` runs the local experts on their
    rows, sorted by local expert (counts[i] for the i-th, a tensor): as a loop or as grouped GEMMs."""
    peers = dist.get_world_size(group)
    per_rank = len(local)
    send = counts.view(peers, per_rank)
    recv = torch.empty_like(send)
    _all_to_all(recv, send, group=group)  # recv[j, i]: rows from peer j for local expert i
    in_splits, out_splits = send.sum(1).tolist(), recv.sum(1).tolist()
    received = _AllToAll.apply(rows, out_splits, in_splits, group)
    expert_of = torch.repeat_interleave(torch.arange(per_rank, device=rows.device).repeat(peers), recv.flatten())
    by_expert = torch.argsort(expert_of, stable=True)  # peer order kept within each expert
    outputs = experts(recv.sum(0), received[by_expert])
    back = torch.empty_like(outputs).index_copy(0, by_expert, outputs)  # peer-major again
    return _AllToAll.apply(back, in_splits, out_splits, group)
