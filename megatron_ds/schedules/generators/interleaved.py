"""Interleaved 1F1B (Megatron's virtual pipeline): v chunks per rank, stage s on rank s mod p.

Micro-batches go through the chunks in groups of p: rank r runs forwards of micro-batches
0..p-1 on chunk 0, then the same group on chunk 1, ..., then the next group. Backwards walk
the chunks in reverse. Warm-up is 2(p-1-r) + (v-1)p chunk forwards, then 1F1B.
The same ordering serves Seq1F1B-I, whose units are (micro-batch, segment) pairs.
"""
from __future__ import annotations

from typing import Sequence

from ..kinds import BW, F, Kind
from ..ir import Op, Schedule, ScheduleError
from .. import placement
from .common import one_f_one_b


def check(pp: int, n_units: int, v: int, name: str, what: str = "micro_batches") -> None:
    if n_units % pp:
        raise ScheduleError(f"{name} with virtual_stages={v} needs {what} to be a multiple of pp "
                            f"({what}={n_units}, pp={pp}), as Megatron's interleaved schedule does")


def chunk_orders(pp: int, v: int, rank: int, fwd_units: Sequence, bwd_units: Sequence,
                 backward_kind: Kind = BW) -> tuple[list[Op], list[Op]]:
    """Forward and backward op orders of one rank over work units (mb, seq)."""
    n = len(fwd_units)
    fwd, bwd = [], []
    for i in range(n * v):
        group, pos = divmod(i, pp * v)
        chunk = pos // pp
        unit = group * pp + pos % pp
        mb, q = fwd_units[unit]
        fwd.append(Op(F, 0, chunk * pp + rank, mb, q))
        mb, q = bwd_units[unit]
        bwd.append(Op(backward_kind, 0, (v - 1 - chunk) * pp + rank, mb, q))
    return fwd, bwd


def interleaved(pp: int, m: int, v: int, *, k: int = 1, name: str = "interleaved",
                fwd_units=None, bwd_units=None) -> Schedule:
    fwd_units = fwd_units or [(mb, 0) for mb in range(m)]
    bwd_units = bwd_units or fwd_units
    ranks = []
    for r in range(pp):
        fwd, bwd = chunk_orders(pp, v, r, fwd_units, bwd_units)
        warmup = 2 * (pp - 1 - r) + (v - 1) * pp + (k - 1)
        ranks.append(one_f_one_b(fwd, bwd, warmup))
    return Schedule(name, pp, m, 1, v * pp, k, placement.interleaved(pp, v), ranks)
