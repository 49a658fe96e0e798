"""Interleaved 1F1B (Megatron's virtual pipeline): v chunks per rank, stage s on rank s mod p.

Micro-batches go through the chunks in groups of g: rank r runs forwards of micro-batches
0..g-1 on chunk 0, then the same group on chunk 1, ..., then the next group. Backwards walk
the chunks in reverse. Warm-up is 2(p-1-r) + (v-1)g chunk forwards, then 1F1B.
Megatron uses g = p and so needs m % p == 0; like PyTorch's flexible ScheduleInterleaved1F1B,
any m runs in rounds = max(1, m // p) equal groups of g = m / rounds micro-batches, which
needs only m % rounds == 0 (g = p when m is a multiple of p: the same schedule).
The same ordering serves Seq1F1B-I, whose units are (micro-batch, segment) pairs, with g = p.
"""
from __future__ import annotations

from typing import Sequence

from ..kinds import BW, F, Kind
from ..ir import Op, Schedule, ScheduleError
from .. import placement
from .common import one_f_one_b, paired_one_f_one_b


def group_size(pp: int, m: int) -> int:
    """Micro-batches per round: m split into max(1, m // pp) equal rounds (0: impossible)."""
    rounds = max(1, m // pp)
    return 0 if m % rounds else m // rounds


def check_rounds(pp: int, m: int, v: int) -> None:
    if not group_size(pp, m):
        rounds = max(1, m // pp)
        raise ScheduleError(f"interleaved with virtual_stages={v} needs micro_batches to split into "
                            f"max(1, micro_batches // pp) = {rounds} equal rounds "
                            f"(micro_batches={m}, pp={pp}), as PyTorch's interleaved schedule does")


def check(pp: int, n_units: int, v: int, name: str, what: str = "micro_batches") -> None:
    if n_units % pp:
        raise ScheduleError(f"{name} with virtual_stages={v} needs {what} to be a multiple of pp "
                            f"({what}={n_units}, pp={pp}), as Megatron's interleaved schedule does")


def chunk_orders(pp: int, v: int, rank: int, fwd_units: Sequence, bwd_units: Sequence,
                 backward_kind: Kind = BW, group: int = 0) -> tuple[list[Op], list[Op]]:
    """Forward and backward op orders of one rank over work units (mb, seq), `group` (default
    pp) units per round."""
    n, g = len(fwd_units), group or pp
    fwd, bwd = [], []
    for i in range(n * v):
        rnd, pos = divmod(i, g * v)
        chunk = pos // g
        unit = rnd * g + pos % g
        mb, q = fwd_units[unit]
        fwd.append(Op(F, 0, chunk * pp + rank, mb, q))
        mb, q = bwd_units[unit]
        bwd.append(Op(backward_kind, 0, (v - 1 - chunk) * pp + rank, mb, q))
    return fwd, bwd


def interleaved(pp: int, m: int, v: int, *, k: int = 1, name: str = "interleaved",
                fwd_units=None, bwd_units=None) -> Schedule:
    flexible = fwd_units is None
    fwd_units = fwd_units or [(mb, 0) for mb in range(m)]
    bwd_units = bwd_units or fwd_units
    g = group_size(pp, m) if flexible else pp
    ranks = []
    for r in range(pp):
        fwd, bwd = chunk_orders(pp, v, r, fwd_units, bwd_units, group=g)
        warmup = 2 * (pp - 1 - r) + (v - 1) * g + (k - 1)
        ranks.append(one_f_one_b(fwd, bwd, warmup))
    return Schedule(name, pp, m, 1, v * pp, k, placement.interleaved(pp, v), ranks)


def interleaved_overlapped(pp: int, m: int, v: int, name: str = "interleaved") -> Schedule:
    """Interleaved 1F1B with its steady state's (forward, backward) pairs as overlapped units (Megatron's
    combined 1F1B for the virtual pipeline): one more warm-up forward than `interleaved`, as Megatron adds,
    so that no unit pairs a chunk's forward with that chunk's backward of the same micro-batch."""
    g = group_size(pp, m)
    units = [(mb, 0) for mb in range(m)]
    ranks, overlap = [], []
    for r in range(pp):
        fwd, bwd = chunk_orders(pp, v, r, units, units, group=g)
        ops, pairs = paired_one_f_one_b(fwd, bwd, 2 * (pp - 1 - r) + (v - 1) * g + 1)
        ranks.append(ops)
        overlap.append(pairs)
    return Schedule(name, pp, m, 1, v * pp, 1, placement.interleaved(pp, v), ranks, overlap=overlap)
