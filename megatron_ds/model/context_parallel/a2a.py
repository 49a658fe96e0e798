"""--cp-comm-type a2a (DeepSpeed-Ulysses): heads traded for sequence, attention of the whole sequence, and back.

Before attention one all-to-all turns each rank's (all heads, s / C tokens) into (heads / C, the whole sequence):
rank r sends its tokens of head group j to rank j and puts what it receives in global order. Each rank then
attends whole sequences, for its head group only, exactly as a single process does (causal, packed documents,
ALiBi with its heads' slopes, a Seq1F1B segment through the K/V cache, whose buffers hold the group's heads), and
a second all-to-all brings the output back to (all heads, s / C tokens). Query head group j's K/V heads are K/V
head group j (grouped-query attention keeps its grouping), so the K/V heads per TP rank must divide by C.

Under --cp-comm-type a2a+p2p the same exchange runs over the inner group of A consecutive CP ranks
(`outer_layout`): a rank then holds its head group's positions of the A ranks' chunks, which are two runs of A
consecutive chunks (CP ranks pA .. pA + A - 1 hold chunks pA .. pA + A - 1 and 2C - pA - A .. 2C - 1 - pA): the
two chunks outer rank p holds of the layout over P ranks. Put in that order, they are what the ring over the
outer group (p2p at CP P) attends.

Cost per layer: three all-to-alls of q, k, v (and their gradients backward) and one of the output, each moving
(C - 1) / C of a tensor a rank holds; no rank ever holds more than 1 / C of any activation.
"""
import torch
import torch.distributed as dist

from ..tensor_parallel.comm import CommCounter
from .layout import ContextLayout


class _AllToAll(torch.autograd.Function):
    """(C, ...) -> (C, ...): out[i] is rank i's x[this rank]; the exchange is its own adjoint."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        CommCounter.record("cp_all_to_all", x)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _AllToAll.apply(grad, ctx.group), None


def heads_problem(heads: int, cp: int, what: str = "K/V heads", inner: bool = False) -> str:
    """Why `heads` cannot be shared out over `cp` ranks ('' when they can); `inner`: a2a+p2p's all-to-all over
    the A ranks of --hierarchical-context-parallel-sizes."""
    if heads % cp == 0:
        return ""
    if inner:
        return (f"--cp-comm-type a2a+p2p shares the attention heads out over the first of "
                f"--hierarchical-context-parallel-sizes: {heads} {what} per tensor-parallel rank do not divide by "
                f"{cp}; make it a divisor of them")
    return (f"--cp-comm-type a2a shares the attention heads out over the context-parallel ranks: {heads} {what} "
            f"per tensor-parallel rank do not divide by --context-parallel-size {cp}; use p2p or allgather")


def sequence_to_heads(x, group, outer_layout=False):
    """(b, heads, s / C, d), this rank's tokens of every head -> (b, heads / C, s, d), its head group's whole
    sequence (or Seq1F1B segment) in global order; `outer_layout` (a2a+p2p, `group` the inner one): its head
    group's tokens of the inner group's ranks, as outer rank p's two chunks (the module's docstring)."""
    layout = ContextLayout.of(group)
    problem = heads_problem(x.shape[1], layout.size, inner=outer_layout)
    if problem:
        raise ValueError(problem)
    b, h, s, d = x.shape
    parts = list(_AllToAll.apply(x.view(b, layout.size, h // layout.size, s, d).transpose(0, 1), group).unbind(0))
    if outer_layout:  # the ranks' first chunks in rank order, then their second ones in reverse
        halves = [part.chunk(2, dim=2) for part in parts]
        return torch.cat([first for first, _ in halves] + [second for _, second in reversed(halves)], dim=2)
    return layout.unshard(parts, dim=2)


def heads_to_sequence(y, group, outer_layout=False):
    """The inverse of sequence_to_heads: (b, heads / C, s, d) in global order (or in the outer layout) ->
    (b, heads, s / C, d)."""
    layout = ContextLayout.of(group)
    if outer_layout:
        pieces = y.chunk(2 * layout.size, dim=2)
        parts = torch.stack([torch.cat((pieces[r], pieces[-1 - r]), dim=2) for r in range(layout.size)])
    else:
        parts = torch.stack([ContextLayout(layout.size, r).shard(y, dim=2) for r in range(layout.size)])
    back = _AllToAll.apply(parts, group)  # back[j]: head group j of this rank's tokens
    groups, b, heads, s, d = back.shape
    # laid out (b, s, heads, d), as SDPA lays out its output: the layer's transpose back to tokens and the reshape
    # for c_proj are views of it, not a second copy
    return back.permute(1, 3, 0, 2, 4).reshape(b, s, groups * heads, d).transpose(1, 2)
