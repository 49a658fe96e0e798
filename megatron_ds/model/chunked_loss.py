"""The LM head and its cross-entropy, a chunk of tokens at a time (--loss-chunk-size): the (tokens x
vocabulary) logits are never whole (8192 tokens x 50304 are 1.6 GB in fp32 per micro-batch). Liger-Kernel
calls this fused linear cross-entropy; here it is a custom autograd Function in plain torch.

Forward: per chunk, logits = hidden @ W^T (in the model's dtype, then fp32 as gpt_loss does), and of them
only each token's log-sum-exp and target logit are kept. The arithmetic between the GEMMs is a pair of pure
functions (ChunkMath), compiled with "pipeline.compile_layers". Backward recomputes each chunk's logits and
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
import functools

import torch
import torch.distributed as dist

from .compile import compile_loss
from .linear import WeightGradStore, accumulate_grad
from .tensor_parallel import comm


def _chunks(n, size):
    return [(start, min(start + size, n)) for start in range(0, n, size)]


def _local_target(labels, vocab_local, group):
    """Each token's target as an index into this rank's vocabulary slice, and whether it lies outside."""
    local = labels - comm.rank(group) * vocab_local
    outside = (local < 0) | (local >= vocab_local)
    return local.masked_fill(outside, 0), outside


def _lse_and_target(logits, local, outside, group):
    """Each token's log-sum-exp and target logit (fp32) of a chunk's logits (the model's dtype), in place
    on their fp32 copy; under tensor parallelism (`group`) the max, the target logit and the sum of
    exponentials each take an all-reduce."""
    logits = logits.float()
    top = logits.max(dim=-1).values
    if group is not None:
        top = comm.all_reduce(top, group, op=dist.ReduceOp.MAX)
    logits.sub_(top.unsqueeze(-1))
    picked = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
    total = logits.exp_().sum(dim=-1)
    if group is not None:
        picked, total = comm.all_reduce(picked, group), comm.all_reduce(total, group)
    return torch.log(total) + top, picked + top


def _grad_from_logits(logits, local, outside, lse, scale):
    """d loss / d logits of a chunk, in the logits' dtype: (softmax - one-hot) x scale, in place on one
    fp32 buffer."""
    grad = (logits.float() - lse.unsqueeze(-1)).exp_()
    grad.scatter_add_(-1, local.unsqueeze(-1), (outside.to(grad.dtype) - 1.0).unsqueeze(-1))
    return grad.mul_(scale).to(logits.dtype)


# The same two as pure expressions, for inductor (ChunkMath): in place and scattered, as eager wants them,
# it fuses less (a scatter ends a kernel; on CPU in fp32 the compiled backward took 1.5x eager's time), and
# fp32 logits would be mutated inputs; pure, the forward is one reduction over the logits as they came and
# the backward one kernel to their gradient.
def _fused_lse_and_target(logits, local, outside):
    logits = logits.float()
    return torch.logsumexp(logits, dim=-1), logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)


def _fused_grad_from_logits(logits, local, outside, lse, scale):
    prob = torch.exp(logits.float() - lse.unsqueeze(-1))
    hit = (torch.arange(logits.shape[-1], device=logits.device) == local.unsqueeze(-1)) & ~outside.unsqueeze(-1)
    return (torch.where(hit, prob - 1.0, prob) * scale).to(logits.dtype)


class ChunkMath:
    """The per-chunk arithmetic around the GEMMs: eager, or (`compiled`, with "pipeline.compile_layers")
    compiled regions, which fuse what eager runs as about five passes over a fp32 (chunk x vocabulary)
    tensor, forward and backward each, into one over the chunk's logits. Under tensor parallelism the
    forward stays eager (its all-reduces sit between its reductions)."""

    def __init__(self, compiled: bool):
        self.fused = (compile_loss(_fused_lse_and_target), compile_loss(_fused_grad_from_logits)) if compiled else None

    def lse_and_target(self, logits, local, outside, group):
        if self.fused and group is None:
            return self.fused[0](logits, local, outside)
        return _lse_and_target(logits, local, outside, group)

    def grad_logits(self, hidden, weight, labels, lse, scale, group):
        """d loss / d logits of one chunk (recomputed from hidden @ weight^T), in the model's dtype."""
        local, outside = _local_target(labels, weight.shape[0], group)
        grad_from_logits = self.fused[1] if self.fused else _grad_from_logits
        return grad_from_logits(torch.matmul(hidden, weight.t()), local, outside, lse, scale)


@functools.lru_cache(maxsize=None)
def chunk_math(compiled: bool) -> ChunkMath:
    """One ChunkMath of each kind per process (the compiled one made at its first use: dynamo's import
    takes seconds, which an eager run never pays)."""
    return ChunkMath(compiled)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk, scale, group, math):
        h2, y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
        lse = torch.empty(h2.shape[0], dtype=torch.float32, device=hidden.device)
        target = torch.empty_like(lse)
        for start, end in _chunks(h2.shape[0], chunk):
            local, outside = _local_target(y[start:end], weight.shape[0], group)
            lse[start:end], target[start:end] = math.lse_and_target(torch.matmul(h2[start:end], weight.t()), local,
                                                                    outside, group)
        scored = (y >= 0).to(lse.dtype)  # a label below 0 (documents.IGNORE) is not scored
        ctx.save_for_backward(h2, weight, y, lse, scored)
        ctx.chunk, ctx.scale, ctx.group, ctx.shape, ctx.math = chunk, scale, group, hidden.shape, math
        return ((lse - target) * scored).sum() * scale

    @staticmethod
    def backward(ctx, grad_loss):
        h2, weight, y, lse, scored = ctx.saved_tensors
        scale = (grad_loss.float() * ctx.scale * scored).unsqueeze(-1)  # per token
        chunks = _chunks(h2.shape[0], ctx.chunk)
        grad_hidden = torch.empty_like(h2) if ctx.needs_input_grad[0] else None
        want_weight = ctx.needs_input_grad[1]
        defer = want_weight and WeightGradStore._queue is not None
        grad_weight = torch.zeros_like(weight) if want_weight and not defer else None
        for start, end in chunks:
            if grad_hidden is None and (defer or not want_weight):
                break
            grad = ctx.math.grad_logits(h2[start:end], weight, y[start:end], lse[start:end], scale[start:end],
                                        ctx.group)
            if grad_hidden is not None:
                grad_hidden[start:end] = grad.matmul(weight)
            if grad_weight is not None:
                grad_weight.addmm_(grad.t(), h2[start:end])
        if defer:  # the W op recomputes the logits: nothing of vocabulary size waits for it
            group, math = ctx.group, ctx.math

            @torch.no_grad()  # the W op runs outside autograd's backward: no graph of its own
            def weight_pass():
                total = None
                for start, end in chunks:
                    grad = math.grad_logits(h2[start:end], weight, y[start:end], lse[start:end], scale[start:end],
                                            group)
                    part = grad.t().matmul(h2[start:end])
                    total = part if total is None else total.add_(part)
                accumulate_grad(weight, total)
            WeightGradStore._queue.append(weight_pass)
        grad_hidden = None if grad_hidden is None else grad_hidden.view(ctx.shape)
        return grad_hidden, grad_weight, None, None, None, None, None


def chunked_linear_cross_entropy(hidden, weight, labels, chunk, group=None, compiled=False):
    """gpt_loss(hidden @ weight^T, labels) (vocab_parallel_loss with `group`), `chunk` tokens at a time.
    `labels` is a tensor (mean over tokens) or (labels, num_tokens) (a Seq1F1B segment's sum / count); a
    label below 0 (documents.IGNORE, --eod-mask-loss) is not scored. `compiled`: the arithmetic between the GEMMs compiled (ChunkMath; under tensor parallelism the
    backward's, as the forward's all-reduces sit between its reductions)."""
    if isinstance(labels, (tuple, list)):
        labels, num_tokens = labels
        scale = 1.0 / num_tokens
    else:  # the mean over the scored tokens (a label below 0 is not: documents.IGNORE)
        scale = 1.0 / (labels >= 0).sum().clamp(min=1)  # a tensor: no wait for the device
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, labels, chunk, scale, group, chunk_math(compiled))
