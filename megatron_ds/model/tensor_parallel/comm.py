"""The tensor-parallel collectives, each along one tensor dimension, and a counter of them.

A group of None is tensor parallelism of size 1: every collective is then the identity,
so the parallel layers also run in a single process without torch.distributed.
Every collective the parallel layers issue passes through here, so `CommCounter` sees
them all (bench/tensor_parallel_comm.py and the tests compare it with Megatron's formulas).
"""
from contextlib import contextmanager

import torch
import torch.distributed as dist

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def world_size(group):
    return 1 if group is None else dist.get_world_size(group)


def rank(group):
    return 0 if group is None else dist.get_rank(group)


class CommCounter:
    """Records (op, bytes of the full tensor) for every tensor-parallel collective in its scope, and every
    context-parallel one (ops named cp_*: model/context_parallel/)."""
    _active = None

    def __init__(self):
        self.calls = []

    @classmethod
    @contextmanager
    def counting(cls):
        previous, cls._active = cls._active, cls()
        try:
            yield cls._active
        finally:
            cls._active = previous

    @classmethod
    def record(cls, op, tensor):
        if cls._active is not None:
            cls._active.calls.append((op, tensor.numel() * tensor.element_size()))

    def summary(self):
        """{op: (count, bytes)}."""
        out = {}
        for op, nbytes in self.calls:
            count, total = out.get(op, (0, 0))
            out[op] = (count + 1, total + nbytes)
        return out


def all_reduce(x, group, op=dist.ReduceOp.SUM):
    """The reduction over the group, into a new tensor (x may be shared with other autograd users)."""
    if world_size(group) == 1:
        return x
    x = x.clone(memory_format=torch.contiguous_format)
    CommCounter.record("all_reduce", x)
    dist.all_reduce(x, op=op, group=group)
    return x


def all_gather(x, dim, group):
    """The group's pieces concatenated along dim, in rank order."""
    n = world_size(group)
    if n == 1:
        return x
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((n * x.shape[0], *x.shape[1:]))
    CommCounter.record("all_gather", out)
    _all_gather_single(out, x, group=group)
    return out.movedim(0, dim)


def _check_splits(x, dim, n):
    if x.shape[dim] % n:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} does not split over {n} tensor-parallel ranks")


def reduce_scatter(x, dim, group):
    """This rank's piece along dim of the group's sum."""
    n = world_size(group)
    if n == 1:
        return x
    _check_splits(x, dim, n)
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((x.shape[0] // n, *x.shape[1:]))
    CommCounter.record("reduce_scatter", x)
    _reduce_scatter_single(out, x, group=group)
    return out.movedim(0, dim)


def split(x, dim, group):
    """This rank's piece along dim (no communication)."""
    n = world_size(group)
    if n == 1:
        return x
    _check_splits(x, dim, n)
    return x.chunk(n, dim)[rank(group)].contiguous()
