"""Cross-entropy over vocab-parallel logits, in fp32, without gathering the logits.

Each rank holds logits for its slice of the vocabulary. Three all-reduces of one value
per token (the max, the target's logit, the sum of exponentials) give every rank the
exact loss; the gradient, softmax minus one-hot, is then local to each slice.
"""
import torch
import torch.distributed as dist

from . import comm


class _VocabParallelCrossEntropy(torch.autograd.Function):

    @staticmethod
    def forward(ctx, logits, target, group):
        ctx.dtype = logits.dtype
        logits = logits.float()
        logits = logits - comm.all_reduce(logits.max(dim=-1).values, group, op=dist.ReduceOp.MAX).unsqueeze(-1)
        vocab_local = logits.shape[-1]
        local_target = target - comm.rank(group) * vocab_local
        outside = (local_target < 0) | (local_target >= vocab_local)
        local_target = local_target.masked_fill(outside, 0)
        target_logit = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        target_logit = comm.all_reduce(target_logit, group)
        exp = logits.exp()
        sum_exp = comm.all_reduce(exp.sum(dim=-1), group)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        return torch.log(sum_exp) - target_logit

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, local_target.unsqueeze(-1), (outside.to(grad.dtype) - 1.0).unsqueeze(-1))
        return grad.mul_(grad_loss.unsqueeze(-1)).to(ctx.dtype), None, None


def vocab_parallel_cross_entropy(logits, target, group):
    """Per-token fp32 loss, shaped like target; logits (..., vocab / TP) are this rank's slice."""
    return _VocabParallelCrossEntropy.apply(logits, target, group)


def vocab_parallel_loss(logits, labels, group):
    """layers.gpt_loss on vocab-parallel logits: the mean token loss, or with (labels, num_tokens)
    (a Seq1F1B segment) the segment's summed loss over the whole micro-batch's token count. A label
    below 0 (documents.IGNORE: --eod-mask-loss) is not scored, nor counted in the mean."""
    summed = isinstance(labels, (tuple, list))
    labels, num_tokens = labels if summed else (labels, None)
    scored = labels >= 0
    loss = vocab_parallel_cross_entropy(logits, labels, group).masked_fill(~scored, 0.0).sum()
    return loss / (num_tokens if summed else scored.sum())
