"""Deferred weight gradients out of a compiled layer: the B/W split with the linears in the graph.

A compiled graph's backward is one autograd node that computes every gradient it owes at once, so a
linear layer inside it cannot queue its weight GEMM for the W op in Python, as an eager layer does
(linear.WeightGradStore). Instead the runtime gives each of a compiled layer's linears two carriers
for a forward op: stride-0 tensors (no memory) of the shapes of the linear's output and input, which
the layer takes as inputs of its graph. The linear's backward leaves its weight GEMM out and returns,
as the gradients of the carriers, its two operands: the output gradient and the input. Both come out
of the graph as its outputs (no copy), and autograd hands them to the one eager node that made the
carriers (`_Carry`), which runs when the op's backward has passed every layer: inside a B op it queues
each weight GEMM for the W op, in a fused backward it computes it at once
(linear.accumulate_weight_grad, the eager split's own).

Everything else of the layer's backward (input gradients, bias and norm gradients) stays in its
graph, so a B op runs each compiled layer's backward as one graph, and a W op is one GEMM per linear.
"""
import contextlib

import torch

from .linear import accumulate_weight_grad, linear_forward, linear_input_grads


class WeightGradSlot:
    """A dense linear layer's place for its carriers: filled by the runtime (`Carriers.forward`) for a
    forward op of a compiled layer in a run that defers weight gradients; None otherwise."""

    def __init__(self):
        self.grad_out = self.input = None
        self.in_graph = False  # set by compile_layers: the layer runs compiled and defers its weight GEMM

    def fits(self, x, weight):
        """Whether the carriers are there and have the shapes of this call's input and output (static:
        a compiled graph decides this when traced)."""
        return (self.input is not None and self.input.shape == x.shape and self.input.dtype == x.dtype
                and self.grad_out.shape == (*x.shape[:-1], weight.shape[0]))

    def linear(self, x, weight, bias):
        return _CarriedLinear.apply(x, weight, bias, self.grad_out, self.input)


class _CarriedLinear(torch.autograd.Function):
    """F.linear whose backward gives the weight GEMM's operands (grad_out, x) to the carriers instead
    of computing it."""

    @staticmethod
    def forward(ctx, x, weight, bias, grad_carrier, input_carrier):
        return linear_forward(ctx, x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, _, grad_x, grad_bias = linear_input_grads(ctx, grad_out)
        return grad_x, None, grad_bias, grad_out, x


class _Carry(torch.autograd.Function):
    """Makes a forward op's carriers (eager, once per op); its backward receives what they carried."""

    @staticmethod
    def forward(ctx, anchor, weights, bases, leading):
        """bases: [(0-d tensor, features)], the output's and the input's of each weight in turn."""
        ctx.weights = weights
        ctx.set_materialize_grads(False)  # a linear the graph did not run carries nothing (None)
        return tuple(base.expand(*leading, features) for base, features in bases)

    @staticmethod
    def backward(ctx, *carried):
        for weight, grad_out, x in zip(ctx.weights, carried[0::2], carried[1::2]):
            if grad_out is not None and weight.requires_grad:  # run by the graph, not frozen
                accumulate_weight_grad(weight, grad_out, x)  # in a B op: queued for its W
        return None, None, None, None


class Carriers:
    """The carriers of one pipeline chunk's compiled linears (modules with a `w_slot` marked in_graph)."""

    def __init__(self, linears):
        self._weights = [m.weight for m in linears]
        self._slots = [m.w_slot for m in linears]
        self._anchor = None  # a leaf that never gets a gradient: it only makes the carriers require one
        # A 0-d base per carrier, kept across ops: carriers that alias one another would make AOTAutograd
        # merge them. Of the weight's dtype: autograd would cast a gradient of another dtype (a copy).
        self._bases = None

    @classmethod
    def of(cls, modules):
        """The Carriers of the linears inside `modules` marked in_graph, or None if there are none."""
        linears = [m for module in modules for m in module.modules()
                   if getattr(m, "w_slot", None) is not None and m.w_slot.in_graph]
        return cls(linears) if linears else None

    @contextlib.contextmanager
    def forward(self, leading: tuple):
        """Fill every slot for a forward op whose hidden states have the leading dims `leading`."""
        if self._anchor is None:
            self._anchor = torch.zeros((), device=self._weights[0].device, requires_grad=True)
            self._bases = [(torch.empty((), dtype=w.dtype, device=w.device), features)
                           for w in self._weights for features in w.shape]  # (out, in)
        carriers = _Carry.apply(self._anchor, self._weights, self._bases, leading)
        for slot, grad_out, x in zip(self._slots, carriers[0::2], carriers[1::2]):
            slot.grad_out, slot.input = grad_out, x
        try:
            yield
        finally:
            for slot in self._slots:
                slot.grad_out = slot.input = None
