"""--cp-comm-type a2a (DeepSpeed-Ulysses): heads traded for sequence, attention of the whole sequence, and back.

Before attention one all-to-all turns each rank's (all heads, s / C tokens) into (heads / C, the whole sequence):
rank r sends its tokens of head group j to rank j and puts what it receives in global order. Each rank then
attends whole sequences, for its head group only, exactly as a single process does (causal, packed documents,
ALiBi with its heads' slopes, a Seq1F1B segment through the K/V cache, whose buffers hold the group's heads), and
a second all-to-all brings the output back to (all heads, s / C tokens). Query head group j's K/V heads are K/V
head group j (grouped-query attention keeps its grouping), so the K/V heads per TP rank must divide by C.

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


def heads_problem(heads: int, cp: int, what: str = "K/V heads") -> str:
    """Why `heads` cannot be shared out over `cp` ranks ('' when they can)."""
    if heads % cp:
        return (f"--cp-comm-type a2a shares the attention heads out over the context-parallel ranks: {heads} {what} "
                f"per tensor-parallel rank do not divide by --context-parallel-size {cp}; use p2p or allgather")
    return ""


def sequence_to_heads(x, group):
    """(b, heads, s / C, d), this rank's tokens of every head -> (b, heads / C, s, d), its head group's whole
    sequence (or Seq1F1B segment) in global order."""
    layout = ContextLayout.of(group)
    problem = heads_problem(x.shape[1], layout.size)
    if problem:
        raise ValueError(problem)
    b, h, s, d = x.shape
    parts = _AllToAll.apply(x.view(b, layout.size, h // layout.size, s, d).transpose(0, 1), group)
    return layout.unshard(list(parts.unbind(0)), dim=2)


def heads_to_sequence(y, group):
    """The inverse of sequence_to_heads: (b, heads / C, s, d) in global order -> (b, heads, s / C, d)."""
    layout = ContextLayout.of(group)
    parts = torch.stack([ContextLayout(layout.size, r).shard(y, dim=2) for r in range(layout.size)])
    back = _AllToAll.apply(parts, group)  # back[j]: head group j of this rank's tokens
    return torch.cat(list(back.unbind(0)), dim=1)
