"""A benchmarking layer that takes set times, so CPU ranks behave like GPU pipeline stages.

TimedLayer computes y = x * w (w: one real parameter of `hidden` elements, so activations,
gradients, ZeRO and the optimizer all see real tensors) and sleeps instead of computing:
TF in forward, TB in backward for the input gradient, TW for the weight gradient. Inside a B
op (WeightGradStore.deferring, see linear.py) the weight part - its sleep and its gradient -
is queued for the matching W op; anywhere else (BW, DeepSpeed's own engines) backward sleeps
TB + TW. Sleeping frees the CPU, so p ranks on a 2-core machine run side by side like p
devices with chosen costs.

Costs are seconds per layer and micro-batch, read from a shared TimedCosts at every call,
so a benchmark can change them between iterations. With `seq_length` set, an input of s
tokens costs s / seq_length of that (a sequence segment's share).

Each call lasts its set cost from the moment it starts, its own CPU work included: the real
arithmetic runs first and the sleep fills the rest, as a GPU kernel's launch overlaps the
kernel. This matters here: code that runs after a core has idled is about ten times slower
(cold caches; a 4 KB multiply takes 0.14 ms after a 25 ms sleep, 0.01 ms warm), so sleeping
the full cost and then computing would charge every layer 0.3-0.4 ms that no GPU stage pays.
The engine's own work between layers is not hidden.

A sleep ends late (timer slack, and on a busy machine the wait for a free core: median
0.3 ms, tail 10 ms at load 20 on 2 cores). With `carry_overshoot`, each sleep measures how
late it woke and the next sleep of the process is that much shorter (at most MAX_CARRY), so
a rank's sleeps add up to their set costs.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from megatron_ds.model.linear import WeightGradStore, accumulate_grad


MAX_CARRY = 0.01  # seconds of lateness a sleep may make up for


@dataclass
class TimedCosts:
    tf: float = 0.0
    tb: float = 0.0
    tw: float = 0.0
    seq_length: int = 0  # full sequence length; 0: every call costs the whole micro-batch
    seq_dim: int = 1
    carry_overshoot: bool = False
    head_f: float = 0.0  # TimedLoss only: seconds of the loss stage's head per micro-batch
    head_b: float = 0.0
    late: float = 0.0  # how late the last sleep ended (carry_overshoot)

    def share(self, x) -> float:
        return x.shape[self.seq_dim] / self.seq_length if self.seq_length else 1.0

    def sleep_until(self, deadline):
        """Sleep until time.perf_counter() reaches `deadline`, less the lateness carried over."""
        remaining = deadline - time.perf_counter()
        if remaining <= 0:
            return  # the call's own work overran its cost: nothing to sleep, nothing paid back
        if not self.carry_overshoot:
            time.sleep(remaining)
            return
        owed = min(self.late, MAX_CARRY)
        if owed >= remaining:
            self.late = owed - remaining
            return
        start = time.perf_counter()
        time.sleep(remaining - owed)
        self.late = time.perf_counter() - start - (remaining - owed)

    def sleep(self, seconds):
        self.sleep_until(time.perf_counter() + seconds)


class _TimedFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, weight, costs, scale, start):
        share = costs.share(x)
        ctx.save_for_backward(x, weight)
        ctx.costs, ctx.share, ctx.scale = costs, share, scale
        y = x * weight
        costs.sleep_until(start + costs.tf * scale[0] * share)
        return y

    @staticmethod
    def backward(ctx, grad_out):
        start = time.perf_counter()
        x, weight = ctx.saved_tensors
        costs, share, (_, scale_b, scale_w) = ctx.costs, ctx.share, ctx.scale
        grad_x = grad_out * weight

        def weight_grad(start):
            grad_w = (grad_out * x).reshape(-1, x.shape[-1]).sum(0)
            costs.sleep_until(start + costs.tw * scale_w * share)
            return grad_w

        queue = WeightGradStore._queue
        if queue is None:
            grad_w = weight_grad(start + costs.tb * scale_b * share)
            return grad_x, grad_w, None, None, None
        costs.sleep_until(start + costs.tb * scale_b * share)
        queue.append(lambda: accumulate_grad(weight, weight_grad(time.perf_counter())))
        return grad_x, None, None, None, None


class TimedLayer(torch.nn.Module):
    """y = x * w, taking costs.tf / tb / tw seconds (see the module docstring), each times its entry
    of `scale` (a layer that also carries an embedding's or a head's cost)."""

    def __init__(self, hidden: int, costs: TimedCosts, scale: tuple = (1.0, 1.0, 1.0)):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden))
        self.costs, self.scale = costs, tuple(scale)

    def forward(self, x):
        if isinstance(x, (tuple, list)):  # the first stage gets the batch's input tuple: the input first
            x = x[0]                      # (under vocabulary parallelism: the embedding sum, position ids)
        return _TimedFunction.apply(x, self.weight, self.costs, self.scale, time.perf_counter())


def timed_loss(output, target):
    """Mean squared error: cheap, and gives every layer a real gradient. A sequence segment's
    target comes as (its targets, the whole micro-batch's element count): segment losses then
    sum to the micro-batch's."""
    if isinstance(target, tuple):
        target, count = target
        return ((output - target) ** 2).sum() / count
    return ((output - target) ** 2).mean()


class _HeadTime(torch.autograd.Function):
    """The loss passes through unchanged, taking costs.head_f in forward and costs.head_b in backward."""

    @staticmethod
    def forward(ctx, loss, costs, share, start):
        ctx.costs, ctx.share = costs, share
        costs.sleep_until(start + costs.head_f * share)
        return loss.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.costs.sleep(ctx.costs.head_b * ctx.share)
        return grad, None, None, None


class TimedLoss:
    """timed_loss with an LM head's cost: a heavier last stage (costs.head_f / head_b per micro-batch)."""

    def __init__(self, costs: TimedCosts):
        self.costs = costs

    def __call__(self, output, target):
        start = time.perf_counter()
        return _HeadTime.apply(timed_loss(output, target), self.costs, self.costs.share(output), start)


def timed_layer_specs(num_layers: int, hidden: int, costs: TimedCosts):
    """LayerSpecs of `num_layers` TimedLayers sharing `costs`, for a PipelineModule."""
    from deepspeed.pipe import LayerSpec
    return [LayerSpec(TimedLayer, hidden, costs) for _ in range(num_layers)]
