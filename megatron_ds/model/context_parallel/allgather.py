"""--cp-comm-type allgather: the keys and values of the whole sequence gathered once per layer, then attended.

Each rank gathers every rank's K/V (all_gather over the CP group), puts them in global order, and attends each of
its two query chunks, at positions [a, a + s / 2CP), to the keys [0, a + s / 2CP): the last queries of a prefix,
the causal (or document) attention a single process does for a Seq1F1B segment, so the layer's own core serves
(prefix_attention). In backward each rank's gradients of the gathered K/V go back to their owners and are summed
there (`gather_sequence`'s backward: one all_to_all, then a sum in fp32; gloo has no reduce_scatter).

Cost per layer: one all_gather of K/V forward (each rank receives (C - 1) / C of the sequence's K/V), one
all_to_all of their gradients backward; a rank holds the whole sequence's K/V while it attends (and, under
selective recompute, gathers them again in backward instead of keeping them).
"""
import torch
import torch.distributed as dist

from ..tensor_parallel.comm import CommCounter
from .layout import ContextLayout

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _Gather(torch.autograd.Function):
    """x (local part) -> (C, *x.shape): every rank's part, in rank order; backward: the sum of every rank's
    gradient of this rank's part."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.new_empty((dist.get_world_size(group) * x.numel(),))
        CommCounter.record("cp_all_gather", out)
        _all_gather_single(out, x.reshape(-1), group=group)  # flat: gloo gathers along dim 0 only
        return out.view(-1, *x.shape)

    @staticmethod
    def backward(ctx, grad):
        received = torch.empty_like(grad)
        CommCounter.record("cp_all_to_all", grad)
        dist.all_to_all_single(received, grad.contiguous(), group=ctx.group)  # received[r]: rank r's of my part
        return received.float().sum(0).to(grad.dtype), None


def gather_sequence(x, group, dim=2):
    """The whole sequence (or Seq1F1B segment) in global order from each rank's part x (its two chunks along
    `dim`), differentiable: backward sums the gradients of this rank's positions from every rank."""
    layout = ContextLayout.of(group)
    parts = _Gather.apply(x, group)
    return layout.unshard(list(parts.unbind(0)), dim=dim)
