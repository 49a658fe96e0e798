"""The LM head and its cross-entropy, a chunk of tokens at a time (--loss-chunk-size): the (tokens x
vocabulary) logits are never whole (8192 tokens x 50304 are 1.6 GB in fp32 per micro-batch). Liger-Kernel
calls this fused linear cross-entropy; here it is a custom autograd Function in plain torch.

Forward: per chunk, logits = hidden @ W^T (in the model's dtype, then fp32 as gpt_loss does), and of them
only each token's log-sum-exp and target logit are kept. Backward recomputes each chunk's logits and
turns them into the gradient of the logits, softmax - one-hot (times the loss's scale), which gives the
chunk's input gradient (@ W) and its share of the weight gradient (^T @ hidden). Inside a B op (B/W
split) the weight's share is left for the W op, which recomputes the logits once more: W keeps nothing of
vocabulary size alive between the ops.

With tensor parallelism W is this rank's vocabulary slice: the log-sum-exp and the target logit take one
all-reduce each per chunk (as tensor_parallel.cross_entropy does for whole logits), the input gradient is
summed over the group by the head's input mapping (copy_to_region, or the sequence gather under
sequence parallelism).

The same numbers as the unchunked head + gpt_loss (vocab_parallel_loss under TP), up to the order of the
fp32 sums: mean over tokens, or for a Seq1F1B segment the sum over its tokens / the micro-batch's count.
"""
import torch
import torch.distributed as dist

from .linear import WeightGradStore, accumulate_grad
from .tensor_parallel import comm


def _chunks(n, size):
    return [(start, min(start + size, n)) for start in range(0, n, size)]


def _logits(hidden, weight):
    return torch.matmul(hidden, weight.t()).float()


def _local_target(labels, vocab_local, group):
    """Each token's target as an index into this rank's vocabulary slice, and whether it lies outside."""
    local = labels - comm.rank(group) * vocab_local
    outside = (local < 0) | (local >= vocab_local)
    return local.masked_fill(outside, 0), outside


def _grad_logits(hidden, weight, labels, lse, scale, group):
    """d loss / d logits of one chunk, in the model's dtype: (softmax - one-hot) x scale."""
    logits = _logits(hidden, weight)
    local, outside = _local_target(labels, weight.shape[0], group)
    grad = torch.exp(logits.sub_(lse.unsqueeze(-1)))
    grad.scatter_add_(-1, local.unsqueeze(-1), (outside.to(grad.dtype) - 1.0).unsqueeze(-1))
    return grad.mul_(scale).to(hidden.dtype)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk, scale, group):
        h2, y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
        lse = torch.empty(h2.shape[0], dtype=torch.float32, device=hidden.device)
        target = torch.empty_like(lse)
        for start, end in _chunks(h2.shape[0], chunk):
            logits = _logits(h2[start:end], weight)
            local, outside = _local_target(y[start:end], weight.shape[0], group)
            top = logits.max(dim=-1).values
            if group is not None:
                top = comm.all_reduce(top, group, op=dist.ReduceOp.MAX)
            logits.sub_(top.unsqueeze(-1))
            picked = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
            total = logits.exp_().sum(dim=-1)
            if group is not None:
                picked, total = comm.all_reduce(picked, group), comm.all_reduce(total, group)
            lse[start:end] = torch.log(total) + top
            target[start:end] = picked + top
        ctx.save_for_backward(h2, weight, y, lse)
        ctx.chunk, ctx.scale, ctx.group, ctx.shape = chunk, scale, group, hidden.shape
        return (lse - target).sum() * scale

    @staticmethod
    def backward(ctx, grad_loss):
        h2, weight, y, lse = ctx.saved_tensors
        scale = grad_loss.float() * ctx.scale
        chunks = _chunks(h2.shape[0], ctx.chunk)
        grad_hidden = torch.empty_like(h2) if ctx.needs_input_grad[0] else None
        want_weight = ctx.needs_input_grad[1]
        defer = want_weight and WeightGradStore._queue is not None
        grad_weight = torch.zeros_like(weight) if want_weight and not defer else None
        for start, end in chunks:
            if grad_hidden is None and (defer or not want_weight):
                break
            grad = _grad_logits(h2[start:end], weight, y[start:end], lse[start:end], scale, ctx.group)
            if grad_hidden is not None:
                grad_hidden[start:end] = grad.matmul(weight)
            if grad_weight is not None:
                grad_weight.addmm_(grad.t(), h2[start:end])
        if defer:  # the W op recomputes the logits: nothing of vocabulary size waits for it
            group = ctx.group

            def weight_pass():
                total = None
                for start, end in chunks:
                    grad = _grad_logits(h2[start:end], weight, y[start:end], lse[start:end], scale, group)
                    part = grad.t().matmul(h2[start:end])
                    total = part if total is None else total.add_(part)
                accumulate_grad(weight, total)
            WeightGradStore._queue.append(weight_pass)
        grad_hidden = None if grad_hidden is None else grad_hidden.view(ctx.shape)
        return grad_hidden, grad_weight, None, None, None, None


def chunked_linear_cross_entropy(hidden, weight, labels, chunk, group=None):
    """gpt_loss(hidden @ weight^T, labels) (vocab_parallel_loss with `group`), `chunk` tokens at a time.
    `labels` is a tensor (mean over tokens) or (labels, num_tokens) (a Seq1F1B segment's sum / count)."""
    if isinstance(labels, (tuple, list)):
        labels, num_tokens = labels
        scale = 1.0 / num_tokens
    else:
        scale = 1.0 / labels.numel()
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, labels, chunk, scale, group)
