"""Megatron's tensor-parallel layers: column- and row-parallel linears, the vocab-parallel embedding.

Initial weights do not depend on the tensor-parallel size: every rank fills the full
matrix with `init_method` (drawing from the layer's own generator, as the dense layers
do) and keeps its slice. A weight split along its output dimension may be a stack of
`sections` (fused Q|K|V, SwiGLU's gate|up): each rank then keeps its slice of every
section, so its local output is again [q_r | k_r | v_r] with whole heads.

Weight gradients go through linear.weight_grad, so inside a B op they are deferred to
the W op like the dense layers', and they need no communication: W stays local.
"""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..compile import outside_graph
from ..linear import bias_grad, linear, weight_grad
from ..weight_carriers import WeightGradSlot
from . import comm
from .mappings import SEQ_DIM, copy_to_region, gather_from_region, reduce_from_region, reduce_scatter_to_sequence


def shard(full, rank, world_size, dim=0, sections=None):
    """Rank's slice of `full` along dim: its 1/world of each section, concatenated."""
    sections = sections or [full.shape[dim]]
    return torch.cat([part.chunk(world_size, dim)[rank] for part in full.split(sections, dim)], dim)


def unshard(pieces, dim=0, sections=None):
    """The full tensor from every rank's slice (the inverse of shard)."""
    world = len(pieces)
    sections = sections or [sum(p.shape[dim] for p in pieces)]
    per_rank = [p.split([s // world for s in sections], dim) for p in pieces]
    return torch.cat([per_rank[r][i] for i in range(len(sections)) for r in range(world)], dim)


def mark_parallel(param, dim, group):
    """DeepSpeed's gradient norm counts a parameter with this mark on every tensor-parallel rank
    (and an unmarked one on tensor-parallel rank 0 only); Megatron's attribute names."""
    if group is not None:
        param.tensor_model_parallel = True
        param.partition_dim = dim


def _split_parameter(full_shape, init_method, group, dim, sections=None):
    full = torch.empty(full_shape)
    init_method(full)
    param = nn.Parameter(shard(full, comm.rank(group), comm.world_size(group), dim, sections).contiguous())
    mark_parallel(param, dim, group)
    return param


def _check_divisible(what, sizes, group):
    n = comm.world_size(group)
    for size in sizes:
        if size % n:
            raise ValueError(f"{what} {size} does not split over {n} tensor-parallel ranks")


class _SequenceGatherLinear(torch.autograd.Function):
    """Column-parallel linear of a sequence-parallel input: all-gather the sequence, multiply.

    Only the local shard is saved; the backward gathers it again for the weight gradient
    (as Megatron does) and reduce-scatters the input gradient. In a B op the gathered
    input waits in the W queue, so the W op itself communicates nothing.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        return F.linear(comm.all_gather(x, SEQ_DIM, group), weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[1]:
            grad_weight = weight_grad(weight, grad_out, comm.all_gather(x, SEQ_DIM, ctx.group))
        if ctx.needs_input_grad[0]:
            grad_x = comm.reduce_scatter(grad_out.matmul(weight), SEQ_DIM, ctx.group)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = bias_grad(grad_out)
        return grad_x, grad_weight, grad_bias, None


def column_parallel_linear(x, weight, bias, group, sequence_parallel=False, slot=None):
    """x @ weight_r^T + bias_r on a replicated (or sequence-parallel) input: this rank's output columns.
    `slot`: the dense layer's WeightGradSlot (weight_carriers.py)."""
    if group is None and not sequence_parallel:  # exactly the dense layer
        return linear(x, weight, bias, slot)
    return _tensor_parallel_linear(x, weight, bias, group, sequence_parallel)


@outside_graph  # its collectives run eagerly between a compiled layer's graphs
def _tensor_parallel_linear(x, weight, bias, group, sequence_parallel):
    if sequence_parallel:
        return _SequenceGatherLinear.apply(x, weight, bias, group)
    return linear(copy_to_region(x, group), weight, bias)


class ColumnParallelLinear(nn.Module):
    """Y = X A^T + b with A split along its output rows: rank r computes its columns of Y."""

    def __init__(self, in_features, out_features, *, init_method, bias=True, group=None, sections=None,
                 gather_output=False, sequence_parallel=False):
        super().__init__()
        sections = sections or [out_features]
        if sum(sections) != out_features:
            raise ValueError(f"sections {sections} do not add up to out_features {out_features}")
        if gather_output and len(sections) > 1:
            raise ValueError("gather_output would interleave the sections' slices")
        _check_divisible("output section", sections, group)
        self.group, self.sections = group, sections
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.weight = _split_parameter((out_features, in_features), init_method, group, 0, sections)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features // comm.world_size(group)))
            mark_parallel(self.bias, 0, group)
        self.w_slot = WeightGradSlot() if group is None and not sequence_parallel else None

    def forward(self, x):
        y = column_parallel_linear(x, self.weight, self.bias, self.group, self.sequence_parallel, self.w_slot)
        return gather_from_region(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Y = X A^T + b with A split along its input columns: rank r multiplies its slice of X.

    The partial products are summed by an all-reduce (or, with sequence parallelism, a
    reduce-scatter along the sequence); the bias is added once, after the sum. With
    sequence parallelism each rank's bias gradient covers its own tokens only, so the
    bias is marked `sequence_parallel` and its gradient must be all-reduced over the
    tensor-parallel group before the optimizer step (as Megatron does).
    """

    def __init__(self, in_features, out_features, *, init_method, bias=True, group=None,
                 sequence_parallel=False):
        super().__init__()
        _check_divisible("in_features", [in_features], group)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = _split_parameter((out_features, in_features), init_method, group, 1)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features))
            self.bias.sequence_parallel = sequence_parallel
        self.w_slot = WeightGradSlot() if group is None else None

    def forward(self, x):
        if self.group is None:  # exactly the dense layer
            return linear(x, self.weight, self.bias, self.w_slot)
        return _row_parallel_linear(x, self.weight, self.bias, self.group, self.sequence_parallel)


@outside_graph  # its collectives run eagerly between a compiled layer's graphs
def _row_parallel_linear(x, weight, bias, group, sequence_parallel):
    partial = linear(x, weight)
    y = reduce_scatter_to_sequence(partial, group) if sequence_parallel else reduce_from_region(partial, group)
    return y if bias is None else y + bias


class VocabParallelEmbedding(nn.Module):
    """The embedding table split by vocabulary rows: each rank looks up the tokens it holds,
    zeros the others, and the group sums (or, sequence-parallel, reduce-scatters) the rows."""

    def __init__(self, num_embeddings, embedding_dim, *, init_method, group=None, sequence_parallel=False):
        super().__init__()
        _check_divisible("vocabulary size", [num_embeddings], group)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.num_local = num_embeddings // comm.world_size(group)
        self.vocab_start = comm.rank(group) * self.num_local
        self.weight = _split_parameter((num_embeddings, embedding_dim), init_method, group, 0)

    def forward(self, tokens):
        if self.group is None:  # the whole table: no token outside it to zero, no group to sum over
            return F.embedding(tokens, self.weight)
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.num_local)
        rows = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(rows, self.group)
        return reduce_from_region(rows, self.group)


def gather_full(module, name, tensor, group):
    """The whole (TP size 1) tensor of `module`'s parameter `name` (or its gradient) from every rank's
    slice: a collective over the group; a replicated parameter's tensor as it is."""
    if group is None:
        return tensor
    if isinstance(module, ColumnParallelLinear):
        dim, sections = 0, module.sections
    elif isinstance(module, RowParallelLinear) and name == "weight":
        dim, sections = 1, None
    elif isinstance(module, VocabParallelEmbedding):
        dim, sections = 0, None
    else:
        return tensor
    pieces = [torch.empty_like(tensor) for _ in range(comm.world_size(group))]
    dist.all_gather(pieces, tensor.contiguous(), group=group)
    return unshard(pieces, dim, sections)
