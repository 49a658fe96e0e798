"""The deferrable linear layer's W: into an existing gradient the GEMM accumulates itself (gradient
accumulation fusion), equal to autograd's fused backward that adds each micro-batch's gradient."""
import torch

from megatron_ds.model import WeightGradStore
from megatron_ds.model.linear import Linear


def layers():
    torch.manual_seed(0)
    fused = Linear(48, 32)
    split = Linear(48, 32)
    split.load_state_dict(fused.state_dict())
    return fused, split


def test_deferred_w_accumulates_over_micro_batches_as_the_fused_backward_does():
    fused, split = layers()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 16, 48, generator=g), torch.randn(4, 16, 32, generator=g)) for _ in range(3)]
    grads = []
    for i, (x, dy) in enumerate(batches):
        fused(x).backward(dy)
        queue = []
        with WeightGradStore.deferring(queue):
            split(x).backward(dy)
        assert len(queue) == 1 and (split.weight.grad is None) == (i == 0)
        before = split.weight.grad
        WeightGradStore.drain(queue)
        if i == 0:
            assert torch.equal(split.weight.grad, fused.weight.grad)  # the very GEMM, no accumulation yet
        else:
            assert split.weight.grad is before  # accumulated in place
        grads.append(split.weight.grad.clone())
        diff = (split.weight.grad - fused.weight.grad).abs().max().item()
        assert diff <= 1e-5 * fused.weight.grad.abs().max().item(), (i, diff)
    assert torch.equal(split.bias.grad, fused.bias.grad)  # B: autograd's own accumulation on both
    assert not torch.equal(grads[0], grads[2])


def test_a_drained_w_records_no_graph():
    """A W op drains its queue with autograd on (the engine's ops run under grad mode): the weight gradient must
    be a plain tensor, or its graph would keep each micro-batch's input and output gradient alive."""
    _, split = layers()
    for step in range(2):  # the first W sets the gradient, the second adds into it
        x = torch.randn(4, 16, 48, requires_grad=True)
        queue = []
        with WeightGradStore.deferring(queue):
            split(x * 1).backward(torch.randn(4, 16, 32))
        assert torch.is_grad_enabled()
        WeightGradStore.drain(queue)
        assert split.weight.grad.grad_fn is None and not split.weight.grad.requires_grad, step
