"""Every process group honours --distributed-timeout-minutes; a collective that fails says which one.

Measured on torch 2.13 (gloo, 4 ranks, one of them SIGSTOPped): init_process_group's timeout is not the
default of later groups. torch.distributed.new_group(timeout=None) takes torch's own default (30
minutes), and DeepSpeed builds its pipeline, data and model groups with new_group(ranks) alone, as do
our replica groups. An all_reduce on such a group waited past 50 s under a 10 s init timeout, while the
same call on a group created with timeout=10 s raised after 10.0 s ("Timed out waiting 10000ms for recv
operation to complete"). `install` therefore

- hands the timeout to every later new_group that does not name one (DeepSpeed's included);
- wraps torch.distributed's collectives and p2p calls, so that a timeout, or the broken connection a
  peer that exited leaves behind, becomes one CollectiveError naming the operation, the group's ranks
  and role (`label_groups`) and the peer of a p2p call: pretrain_gpt.py prints it as one line and every
  rank exits with code 1. Async calls return their Work in a thin wrapper whose wait() does the same;
- starts a watchdog thread for what a group cannot bound itself (a hung kernel, a wait that a backend
  never times out): an operation in flight for longer than the timeout plus a grace period ends the
  process with the same one line. Gloo's own timeout fires first; the watchdog is the safety net.

The wrappers replace the attributes of torch.distributed before DeepSpeed's backend is built (it keeps
references to some of them), and cost one Python call per collective.
"""
import functools
import inspect
import os
import re
import sys
import threading
import time

from megatron_ds.errors import print_error

# Messages of a wait that timed out or of a peer that vanished (gloo, NCCL, the TCP store).
FAILURE_MARKS = ("timed out", "timeout", "connection closed by peer", "connection reset by peer", "broken pipe",
                 "communicator was aborted", "connection refused")
OPS = ("all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base", "reduce_scatter",
       "reduce_scatter_tensor", "_reduce_scatter_base", "reduce", "broadcast", "barrier", "monitored_barrier",
       "send", "recv", "isend", "irecv", "batch_isend_irecv", "gather", "scatter", "all_to_all",
       "all_to_all_single", "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")
PEERS = ("send", "isend", "recv", "irecv")


class CollectiveError(RuntimeError):
    """A collective or p2p call that timed out or lost its peer; the message names the call and the group."""


_state = {"timeout": None, "labels": {}, "inflight": {}, "lock": threading.Lock(), "installed": False}


def label_groups(grid, module=None):
    """Name DeepSpeed's groups by their role in error messages (its PipelineParallelGrid, and the
    tied-weight groups of the PipelineModule, e.g. embedding and LM head on the first and last stage)."""
    for attr, label in (("pp_proc_group", "pipeline"), ("dp_proc_group", "data-parallel"),
                        ("slice_proc_group", "model-parallel"), ("ds_model_proc_group", "model")):
        group = getattr(grid, attr, None)
        if group is not None:
            _state["labels"].setdefault(group, label)
    for comm in (getattr(module, "tied_comms", None) or {}).values():
        if comm.get("group") is not None:
            _state["labels"].setdefault(comm["group"], "tied-weight")


def _describe_group(group):
    import torch.distributed as dist
    try:
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    except Exception:  # noqa: BLE001 - a group this rank is not in, or torch already torn down
        ranks = None
    label = "world" if group is None or group is dist.group.WORLD else _state["labels"].get(group)
    if ranks is None:
        return f"the {label} group" if label else "a process group"
    return f"the {label} group ranks {ranks}" if label else f"group ranks {ranks}"


class _Call:
    """One collective: what it is, for the message, and when it started, for the watchdog."""
    __slots__ = ("name", "group", "peer", "start")

    def __init__(self, name, group, peer):
        self.name, self.group, self.peer, self.start = name, group, peer, time.monotonic()

    def describe(self):
        peer = f" {'to' if self.name in ('send', 'isend') else 'from'} rank {self.peer}" if self.peer is not None else ""
        return f"{self.name}{peer} on {_describe_group(self.group)}"


def _is_peer_failure(error):
    text = str(error).lower()
    return any(mark in text for mark in FAILURE_MARKS)


def _reason(error):
    """gloo's "[.../pair.cc:553] Connection closed by peer [127.0.0.1]:14768. This is typically ..." -> the middle."""
    text = (str(error).strip().splitlines() or [type(error).__name__])[0]
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text)
    return text.split(". This is typically")[0]


def _converted(error, call):
    minutes = _state["timeout"].total_seconds() / 60.0 if _state["timeout"] else None
    first = _reason(error)
    waited = time.monotonic() - call.start
    return CollectiveError(f"{call.describe()} failed after {waited:.1f} s (--distributed-timeout-minutes "
                           f"{minutes:g}): a peer is frozen or died: {first}")


def _track(call):
    with _state["lock"]:
        _state["inflight"][id(call)] = call


def _untrack(call):
    with _state["lock"]:
        _state["inflight"].pop(id(call), None)


class _Work:
    """An async call's Work whose wait() reports a timeout as a CollectiveError."""
    __slots__ = ("_work", "_call")

    def __init__(self, work, call):
        self._work, self._call = work, call

    def wait(self, *args, **kwargs):
        self._call.start = time.monotonic()
        _track(self._call)
        try:
            return self._work.wait(*args, **kwargs)
        except RuntimeError as e:
            if _is_peer_failure(e):
                raise _converted(e, self._call) from e
            raise
        finally:
            _untrack(self._call)

    def __getattr__(self, name):
        return getattr(self._work, name)


def _argument(fn, name):
    """(name, position) of fn's parameter `name`, to find it among positional or keyword arguments."""
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return name, None
    return name, params.index(name) if name in params else None


def _pick(args, kwargs, where):
    name, pos = where
    if name in kwargs:
        return kwargs[name]
    return args[pos] if pos is not None and pos < len(args) else None


def _wrap(name, fn):
    group_at = _argument(fn, "group")
    peer_at = _argument(fn, "dst" if name in ("send", "isend") else "src") if name in PEERS else None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        group = _pick(args, kwargs, group_at)
        if name == "batch_isend_irecv" and args and args[0]:
            group = getattr(args[0][0], "group", None)
        record = _Call(name, group, _pick(args, kwargs, peer_at) if peer_at else None)
        _track(record)
        try:
            out = fn(*args, **kwargs)
        except RuntimeError as e:
            if isinstance(e, CollectiveError) or not _is_peer_failure(e):
                raise
            raise _converted(e, record) from e
        finally:
            _untrack(record)
        if out is None or isinstance(out, (bool, int)):
            return out
        if isinstance(out, list):  # batch_isend_irecv
            return [_Work(w, record) for w in out]
        return _Work(out, record) if hasattr(out, "wait") else out
    call.__wrapped_by_megatron_ds__ = True
    return call


def _unwrapping_p2p_op(base):
    """torch's P2POp refuses an op that is not torch.distributed's own isend or irecv, which the wrapped ones
    are not: it is handed the function they wrap (batch_isend_irecv, wrapped, still names a failed call)."""

    class P2POp(base):
        unwraps_ops = True

        def __new__(cls, op, *args, **kwargs):
            return base.__new__(cls, getattr(op, "__wrapped__", op), *args, **kwargs)

        def __init__(self, op, *args, **kwargs):
            super().__init__(getattr(op, "__wrapped__", op), *args, **kwargs)

    P2POp.__doc__ = base.__doc__
    return P2POp


def report_and_exit(error, rank):
    """The one line every rank prints for a failed collective, then an exit that waits for nothing."""
    print_error(f"rank {rank}: {error}")
    sys.stdout.flush()
    os._exit(1)  # the process group's destructors would wait for the frozen peer


def _watchdog(grace, rank_of):
    while True:
        time.sleep(min(5.0, grace / 4))
        limit = _state["timeout"].total_seconds() + grace
        now = time.monotonic()
        with _state["lock"]:
            late = [c for c in _state["inflight"].values() if now - c.start > limit]
        if late:
            call = late[0]
            report_and_exit(CollectiveError(
                f"{call.describe()} still waiting after {now - call.start:.0f} s, past --distributed-timeout-minutes "
                f"{_state['timeout'].total_seconds() / 60:g} (watchdog): a peer is frozen"), rank_of())


def install(timeout, grace=None):
    """Make later groups carry `timeout` (a timedelta), name failed collectives, start the watchdog.

    Call before the default process group starts (DeepSpeed keeps references to some functions).
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    _state["timeout"] = timeout
    if _state["installed"]:
        return
    _state["installed"] = True
    new_group = dist.new_group

    @functools.wraps(new_group)
    def new_group_with_timeout(*args, **kwargs):
        if kwargs.get("timeout") is None and len(args) < 2:
            kwargs["timeout"] = _state["timeout"]
        return new_group(*args, **kwargs)

    dist.new_group = c10d.new_group = new_group_with_timeout
    if not getattr(dist.P2POp, "unwraps_ops", False):  # batched p2p (context parallelism's ring attention)
        dist.P2POp = _unwrapping_p2p_op(dist.P2POp)
    for name in OPS:
        fn = getattr(dist, name, None)
        if fn is not None and not getattr(fn, "__wrapped_by_megatron_ds__", False):
            setattr(dist, name, _wrap(name, fn))
    grace = grace if grace is not None else max(30.0, 0.25 * timeout.total_seconds())
    rank_of = lambda: dist.get_rank() if dist.is_initialized() else os.environ.get("RANK", "?")  # noqa: E731
    threading.Thread(target=_watchdog, args=(grace, rank_of), name="collective-watchdog", daemon=True).start()
