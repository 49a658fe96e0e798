"""Stage-to-rank placements: placement[replica][stage] = rank."""
from __future__ import annotations


def linear(pp: int) -> list[list[int]]:
    return [list(range(pp))]


def interleaved(pp: int, v: int) -> list[list[int]]:
    # Megatron's virtual pipeline: chunk c of rank r is stage c*pp + r.
    return [[s % pp for s in range(v * pp)]]


def v_shape(pp: int) -> list[list[int]]:
    # Down the ranks and back up, so the first and last stage share rank 0.
    return [[s if s < pp else 2 * pp - 1 - s for s in range(2 * pp)]]


def bitpipe(pp: int) -> list[list[int]]:
    # Two V's in opposite directions: replica 1 is replica 0 mirrored (rank r <-> pp-1-r).
    down = v_shape(pp)[0]
    return [down, [pp - 1 - r for r in down]]
