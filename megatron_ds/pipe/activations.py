"""What one chunk hands the next: our GPT's one tensor, or a user's layers' tensor or tuple of tensors.

DeepSpeed's rule for a PipelineModule's stages, kept here for every chunk: the floating-point tensors of a
received activation are leaves that ask for their gradient (when training), the others travel alongside,
and a gradient message holds the gradients of the floating-point tensors, in order.
"""
import torch


def leaves(x, requires_grad):
    """A received activation as the chunk's own autograd leaves."""
    if torch.is_tensor(x):
        return x.detach().requires_grad_(requires_grad and x.is_floating_point())
    return tuple(leaves(t, requires_grad) for t in x)


def detached(x):
    return x.detach() if torch.is_tensor(x) else tuple(t.detach() for t in x)


def floating(x):
    """The floating-point tensors of `x`, in order: those a gradient message is about."""
    return [t for t in ((x,) if torch.is_tensor(x) else x) if t.is_floating_point()]


def input_grads(x):
    """The gradient message of received activation `x` after its backward (zeros for a tensor that did not
    reach the loss: the sender's backward still expects its gradient)."""
    grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in floating(x)]
    return grads[0] if torch.is_tensor(x) else tuple(grads)
