"""Autograd mappings between the replicated, the tensor-parallel and the sequence-parallel regions.

Each is a pair of collectives, one per direction (Megatron's core/tensor_parallel/mappings.py):

  copy_to_region            forward identity,        backward all-reduce
  reduce_from_region        forward all-reduce,      backward identity
  scatter_to_region         forward split last dim,  backward all-gather last dim
  gather_from_region        forward all-gather last, backward split last dim
  scatter_to_sequence       forward split sequence,  backward all-gather sequence
  gather_from_sequence      forward all-gather seq,  backward reduce-scatter (or split) sequence
  reduce_scatter_to_sequence forward reduce-scatter, backward all-gather sequence

Activations are batch-first (batch, sequence, hidden), so the sequence dimension is 1
(Megatron's is 0). A group of None (no tensor parallelism) maps a tensor to itself.
"""
import torch

from . import comm

SEQ_DIM = 1


class _CopyToRegion(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return comm.all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, group):
        return comm.all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return comm.split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_gather(grad, ctx.dim, ctx.group), None, None


class _GatherFromRegion(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, group, dim, reduce_grad):
        ctx.group, ctx.dim, ctx.reduce_grad = group, dim, reduce_grad
        return comm.all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce_grad:
            return comm.reduce_scatter(grad, ctx.dim, ctx.group), None, None, None
        return comm.split(grad, ctx.dim, ctx.group), None, None, None


class _ReduceScatterToRegion(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return comm.reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_gather(grad, ctx.dim, ctx.group), None, None


def copy_to_region(x, group):
    if group is None:
        return x
    return _CopyToRegion.apply(x, group)


def reduce_from_region(x, group):
    if group is None:
        return x
    return _ReduceFromRegion.apply(x, group)


def scatter_to_region(x, group):
    if group is None:
        return x
    return _ScatterToRegion.apply(x, group, -1)


def gather_from_region(x, group):
    if group is None:
        return x
    return _GatherFromRegion.apply(x, group, -1, False)


def scatter_to_sequence(x, group):
    if group is None:
        return x
    return _ScatterToRegion.apply(x, group, SEQ_DIM)


def gather_from_sequence(x, group, tensor_parallel_output_grad=True):
    """All-gather the sequence. The backward reduce-scatters when the consumer is tensor-parallel
    (each rank holds a partial gradient), and only splits when the consumer is replicated."""
    if group is None:
        return x
    return _GatherFromRegion.apply(x, group, SEQ_DIM, tensor_parallel_output_grad)


def reduce_scatter_to_sequence(x, group):
    if group is None:
        return x
    return _ReduceScatterToRegion.apply(x, group, SEQ_DIM)
