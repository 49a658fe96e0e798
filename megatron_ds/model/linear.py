"""A linear layer whose weight-gradient GEMM can be deferred (zero-bubble B/W split).

In a B op the runtime opens a `WeightGradStore`; every linear layer then returns
the input gradient (and its bias gradient) at once and queues the weight GEMM.
The runtime drains the queue in the matching W op. Outside a B op the layer is
an ordinary linear layer, computing the very same GEMMs, so a split backward is
bit-identical to a fused one; a W that adds to an existing gradient adds inside its
GEMM, where autograd adds the fused backward's result in a pass of its own (equal up
to the rounding of that one addition).
"""
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from .compile import CompileMode, outside_graph


class WeightGradStore:
    """The queue the current B op writes deferred weight GEMMs into (None: compute at once)."""
    _queue = None

    @classmethod
    @contextmanager
    def deferring(cls, queue: list):
        previous, cls._queue = cls._queue, queue
        try:
            yield queue
        finally:
            cls._queue = previous

    @staticmethod
    def drain(queue: list):
        for compute in queue:
            compute()
        queue.clear()


def accumulate_grad(param, grad):
    """param.grad += grad, as autograd's AccumulateGrad does (for gradients made outside autograd; a graph the
    caller's grad made would ride along: it is detached)."""
    with torch.no_grad():
        if param.grad is None:
            param.grad = grad.detach()
        else:
            param.grad.add_(grad)


def _accumulate_product(param, grad_2d, x_2d):
    """param.grad += grad_2d^T x_2d. Into an existing gradient the GEMM adds itself (Megatron's
    gradient accumulation fusion): no temporary and no separate pass over the weight gradient,
    which the W of every micro-batch (and Seq1F1B segment) after the first would otherwise pay. A W op drains
    its queue with autograd on: unguarded, the gradient would record a graph holding the micro-batch's input
    and output gradient until the gradients are cleared."""
    with torch.no_grad():
        if param.grad is None:
            param.grad = grad_2d.t().matmul(x_2d)
        else:
            param.grad.addmm_(grad_2d.t(), x_2d)


def linear_forward(ctx, x, weight, bias):
    """F.linear in an autograd.Function's forward, saving what linear_input_grads needs."""
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None
    return F.linear(x, weight, bias)


def linear_input_grads(ctx, grad_out):
    """A linear's backward but its weight GEMM: (x, weight, grad_x, grad_bias)."""
    x, weight = ctx.saved_tensors
    grad_x = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None
    grad_bias = bias_grad(grad_out) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return x, weight, grad_x, grad_bias


class _LinearFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, weight, bias):
        return linear_forward(ctx, x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, grad_x, grad_bias = linear_input_grads(ctx, grad_out)
        grad_weight = weight_grad(weight, grad_out, x) if ctx.needs_input_grad[1] else None
        return grad_x, grad_weight, grad_bias


def bias_grad(grad_out):
    return grad_out.reshape(-1, grad_out.shape[-1]).sum(0)


def weight_grad(weight, grad_out, x):
    """grad_out^T x over all tokens: returned now, or queued for the W op (then None).

    Every deferrable linear layer (the tensor-parallel ones too) goes through here, so
    a deferred weight gradient is the very GEMM a fused backward computes.
    """
    if WeightGradStore._queue is None:
        return grad_out.reshape(-1, grad_out.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))
    accumulate_weight_grad(weight, grad_out, x)
    return None


def accumulate_weight_grad(weight, grad_out, x):
    """weight.grad += grad_out^T x over all tokens: queued for the W op inside a B op, else now."""
    grad_2d = grad_out.reshape(-1, grad_out.shape[-1])
    x_2d = x.reshape(-1, x.shape[-1])
    queue = WeightGradStore._queue
    if queue is None:
        _accumulate_product(weight, grad_2d, x_2d)
    else:
        queue.append(lambda: _accumulate_product(weight, grad_2d, x_2d))


def linear(x, weight, bias=None, slot=None):
    """F.linear with a deferrable weight gradient. Inside a compiled layer (model/compile.py) it is
    plain F.linear in the graph; when the run defers weight gradients, a linear whose `slot`
    (weight_carriers.WeightGradSlot) the runtime filled for this forward, which hands its weight GEMM
    out of the graph's backward, else an eager call between two graphs (a graph's backward would
    compute the weight GEMM at once)."""
    if torch.compiler.is_compiling():
        if slot is not None and slot.fits(x, weight):
            return slot.linear(x, weight, bias)
        if CompileMode.linears_outside and torch.is_grad_enabled():
            return _eager_linear(x, weight, bias)
        return F.linear(x, weight, bias)
    return _LinearFunction.apply(x, weight, bias)


_eager_linear = outside_graph(_LinearFunction.apply)


class Linear(torch.nn.Linear):
    """nn.Linear (same parameters, same layout) with a deferrable weight gradient."""

    def forward(self, x):
        return linear(x, self.weight, self.bias)
