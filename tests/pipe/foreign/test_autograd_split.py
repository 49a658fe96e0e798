"""pipe/foreign/autograd_split.py: B ops then W ops give every gradient the fused backward gives, bit for bit (input
gradients in B, weight gradients in W where autograd can take them apart), on one process, for layers that
are not ours, ours, and the ones that cannot be split (a custom autograd.Function, a reentrant activation
checkpoint), on a middle stage and on the first (whose inputs need no gradient)."""
import copy

import pytest
import torch
import torch.utils.checkpoint as ckpt

from megatron_ds.model.linear import Linear, WeightGradStore
from megatron_ds.pipe.foreign.autograd_split import Split


class Scale(torch.autograd.Function):
    """A foreign custom Function: x * w, both gradients in one backward call."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad * w, (grad * x).sum(0)


class ScaleLayer(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(0.5, 1.5, n))

    def forward(self, x):
        return Scale.apply(x, self.w)


class Checkpointed(torch.nn.Module):
    """A block under reentrant activation checkpointing (DeepSpeed's default kind)."""

    def __init__(self, n):
        super().__init__()
        self.inner = torch.nn.Sequential(torch.nn.Linear(n, n), torch.nn.Tanh())

    def forward(self, x):
        return ckpt.checkpoint(self.inner, x, use_reentrant=True)


class Pair(torch.nn.Module):
    """Outputs a tuple: the hidden states and a side output that one parameter alone makes (it reaches the
    loss without passing the inputs: an output B does not need)."""

    def __init__(self, n):
        super().__init__()
        self.lin = torch.nn.Linear(n, n)
        self.side = torch.nn.Parameter(torch.ones(n) * 0.3)

    def forward(self, x):
        return torch.tanh(self.lin(x)), self.side * 2.0


class Tied(torch.nn.Module):
    """One weight used twice (as a tied embedding and head are)."""

    def __init__(self, n):
        super().__init__()
        self.lin = torch.nn.Linear(n, n)

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        return torch.nn.functional.linear(h, self.lin.weight.t())


def conv_net():
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                               torch.nn.MaxPool2d(2), torch.nn.GroupNorm(2, 4), torch.nn.Flatten(),
                               torch.nn.Linear(4 * 4 * 4, 8), torch.nn.LayerNorm(8), torch.nn.Dropout(0.0))


def mlp(n=8):
    return torch.nn.Sequential(torch.nn.Linear(n, n), torch.nn.Tanh(), torch.nn.Linear(n, n), torch.nn.Tanh())


MODELS = {
    "linear_tanh": (mlp, (4, 8)),
    "conv_norm": (conv_net, (2, 3, 8, 8)),
    "tied": (lambda: torch.nn.Sequential(Tied(8), torch.nn.Tanh()), (4, 8)),
    "tuple_out": (lambda: Pair(8), (4, 8)),
    "ours": (lambda: torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), Linear(8, 8), torch.nn.Tanh()),
             (4, 8)),
    "custom_function": (lambda: torch.nn.Sequential(torch.nn.Linear(8, 8), ScaleLayer(8), torch.nn.Linear(8, 8)),
                        (4, 8)),
    "reentrant_checkpoint": (lambda: torch.nn.Sequential(torch.nn.Linear(8, 8), Checkpointed(8),
                                                         torch.nn.Linear(8, 8)), (4, 8)),
}


def outputs_of(model, x):
    out = model(x)
    return list(out) if isinstance(out, tuple) else [out]


def output_grads(outs, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(o.shape, generator=g) for o in outs]


def fused(model, xs):
    leaves = []
    for i, x in enumerate(xs):
        leaf = x.detach().clone().requires_grad_(x.requires_grad)
        outs = outputs_of(model, leaf)
        torch.autograd.backward(outs, output_grads(outs, i))
        leaves.append(leaf)
    return leaves


def split(model, xs, first_stage):
    """Both micro-batches' B, then both W (as a zero-bubble schedule runs them). Returns the input leaves,
    the parameters' gradients after the B ops, the W parameters' names and the Functions run whole."""
    leaves, weights, whole = [], [], set()
    params = list(model.parameters())
    for i, x in enumerate(xs):
        leaf = x if first_stage else x.detach().clone().requires_grad_(True)
        outs = outputs_of(model, leaf)
        plan = Split(outs, output_grads(outs, i), [] if first_stage else [leaf], params)
        whole |= plan.whole
        queue = []
        with WeightGradStore.deferring(queue):
            weight = plan.backward_input()
        in_w = {id(p) for p in plan.w_params}
        weights.append((queue, weight, {n for n, p in model.named_parameters() if id(p) in in_w}))
        leaves.append(leaf)
    after_b = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    for queue, weight, _ in weights:
        WeightGradStore.drain(queue)
        if weight is not None:
            weight()
    return leaves, after_b, set().union(*(w for _, _, w in weights)), whole


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("first_stage", [False, True], ids=["middle", "first"])
def test_split_backward_equals_fused(name, first_stage):
    make, shape = MODELS[name]
    torch.manual_seed(0)
    model = make()
    twin = copy.deepcopy(model)
    # the first stage's inputs are data: no gradient, so its B has nothing to send
    xs = [torch.randn(shape, generator=torch.Generator().manual_seed(10 + i)).requires_grad_(not first_stage)
          for i in range(2)]
    ref_leaves = fused(model, xs)
    leaves, after_b, in_w, whole = split(twin, xs, first_stage)
    if not first_stage:
        for a, b in zip(leaves, ref_leaves):
            assert torch.equal(a.grad, b.grad), name
    for (n, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
        # bit for bit, but where our linear adds its second W inside the GEMM (model/linear.py: one rounding)
        same = (torch.allclose(p.grad, q.grad, rtol=0, atol=1e-6) if (name, n) == ("ours", "2.weight")
                else torch.equal(p.grad, q.grad))
        assert q.grad is not None and same, (name, n)
        if n in in_w:
            assert after_b[n] is None, f"{name}: {n} is a W parameter but B gave it a gradient"
    everything = {n for n, _ in model.named_parameters()}
    if first_stage and name != "reentrant_checkpoint":  # B has no input gradient to make: all of it is W's
        assert in_w == everything and whole == set(), name
    elif name == "linear_tanh":
        assert in_w == everything
    elif name == "ours":  # our linear queued its weight GEMM in B: it lands in W; its bias is B's
        assert in_w == {"0.weight", "0.bias"} and after_b["2.weight"] is None and after_b["2.bias"] is not None
    elif name == "custom_function":  # its node computes both gradients at once: its parameter's is B's
        assert whole == {"Scale"} and in_w == {"0.weight", "0.bias", "2.weight", "2.bias"}
    elif name == "reentrant_checkpoint":  # it refuses a partial backward: the whole one runs in B
        assert whole == {"CheckpointFunction"} and in_w == set()


class Branches(torch.nn.Module):
    """A scale, then three parallel linears of its output (as attention's query, key and value are), joined and
    projected: five weight groups, of which the three branches reach none of the others' parameters."""

    def __init__(self, n):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, n))
        self.q, self.k, self.v, self.o = (torch.nn.Linear(n, n) for _ in range(4))

    def forward(self, x):
        h = x * self.scale
        return self.o(torch.tanh(self.q(h)) * self.k(h) + self.v(h))


@pytest.mark.parametrize("first_stage", [False, True], ids=["middle", "first"])
def test_w_calls_autograd_once_for_groups_that_do_not_reach_each_other(first_stage, monkeypatch):
    torch.manual_seed(0)
    model = Branches(8)
    twin = copy.deepcopy(model)
    xs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(10 + i)).requires_grad_(not first_stage)
          for i in range(2)]
    ref_leaves = fused(model, xs)
    calls = []
    grad = torch.autograd.grad

    def counted(outputs, inputs, *args, **kwargs):
        calls.append(len(inputs))
        return grad(outputs, inputs, *args, **kwargs)
    monkeypatch.setattr(torch.autograd, "grad", counted)
    leaves, _, in_w, _ = split(twin, xs, first_stage)
    # per micro-batch, in the parameters' order: the scale; q, k and v together (weights and biases); o (its
    # frontier reaches all the others': apart); one call a group would be 5
    assert in_w == {n for n, _ in model.named_parameters()}
    assert calls == ([1, 6, 2] if not first_stage else [9]) * 2
    if not first_stage:
        for a, b in zip(leaves, ref_leaves):
            assert torch.equal(a.grad, b.grad)
    for (n, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
        assert torch.equal(p.grad, q.grad), n
