"""Vocabulary parallelism's computations ("Balancing Pipeline Parallelism with Vocabulary
Parallelism", Yeung et al., MLSys 2025): the input embedding and the output layer + cross-entropy
sliced by vocabulary over a process group (the pipeline ranks, times the TP ranks when those split
the vocabulary too), one pass per function so that a runtime can place each where its schedule
says (docs/SCHEDULES.md: Vocabulary parallelism). Nothing here knows of schedules: a caller hands
each pass its inputs and runs the collective between passes.

Rank j of the group holds rows [j V/n, (j+1) V/n) of the embedding and of the output layer (the
same tensor when they are tied). Per micro-batch:
- embedding_forward (EF): its rows of the lookup, zero elsewhere; the group's sum is the embedding
  (reduce_embedding: an all-reduce, or a reduce to stage 0's rank).
- embedding_weight_grad (EW): given the embedding's output gradient (broadcast from stage 0), the
  gradient of its rows.
- output_s_pass (S): from the last layer's output X (broadcast to the group) its logits slice, their
  max m_j, s_j = sum exp(logit - m_j), the target's logit where the target falls in the slice, and
  with the slice's own softmax P_j = exp(logits - m_j) / s_j the input-gradient share P_j W_j and
  W_j[target]. No collective inside.
- reduce_statistics (the barrier: three all-reduces back to back, no compute between them that the
  schedule could place; only the loss stage needs the input gradient, which a reduce would do): M = max m_j, S = sum s_j exp(m_j - M),
  the loss log S + M - logit_target per token, alpha_j = s_j exp(m_j - M) / S (P_j alpha_j is the
  slice of the true softmax), and the input gradient sum_j (alpha_j P_j W_j - W_j[target]) times
  the loss's gradient per token.
- output_t_pass (T): the slice's weight gradient (alpha_j P_j - onehot_j)^T X, times the loss's
  gradient per token.
All in fp32 statistics; the logits' dtype is the weight's. With a token chunk (`chunk`, the run's
--loss-chunk-size) S runs a chunk of tokens at a time and keeps only the per-token statistics, and T
recomputes each chunk's logits from X and the slice's weight (one GEMM more, as chunked_loss.py's W):
no (tokens x slice) tensor outlives a chunk or is held from S to T.

Under tensor parallelism (`tp`: the TP group, None without) the TP ranks of one pipeline rank cut its
block of V/p rows again t ways, and run each pass together, so a collective over the TP group is
safe inside one: EF sums the TP ranks' rows into the block's, S all-reduces the statistics into the
block's and sums the input-gradient shares, and every message between pipeline ranks is then what it
is without TP; T and EW stay local. Under sequence parallelism (`sequence_parallel`) the hidden
states and their gradients between stages are this TP rank's shard of the tokens: EF and S
reduce-scatter along the sequence what they sum, S and T gather X, EW gathers its input gradient.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .tensor_parallel import comm
from .tensor_parallel.mappings import SEQ_DIM


def vocab_range(vocab_size: int, rank: int, world: int) -> tuple[int, int]:
    """Rows [start, end) of rank `rank`'s slice; the vocabulary must split evenly (Megatron pads it)."""
    if vocab_size % world:
        raise ValueError(f"vocabulary of {vocab_size} rows does not split over {world} ranks: pad it to a "
                         f"multiple of {world} (--make-vocab-size-divisible-by)")
    per = vocab_size // world
    return rank * per, (rank + 1) * per


def _local(ids: torch.Tensor, start: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids shifted into the slice with those outside set to 0, mask of those outside)."""
    outside = (ids < start) | (ids >= start + rows)
    return (ids - start).masked_fill(outside, 0), outside


# --- the input embedding -------------------------------------------------------------------------

def embedding_forward(ids: torch.Tensor, weight: torch.Tensor, start: int, tp=None,
                      sequence_parallel: bool = False) -> torch.Tensor:
    """EF: this slice's rows of the lookup, zeros for tokens outside it (the group's sum is the lookup);
    with TP summed over the TP group into the block's (SP: this rank's shard of the tokens)."""
    local, outside = _local(ids, start, weight.shape[0])
    rows = torch.nn.functional.embedding(local, weight).masked_fill(outside.unsqueeze(-1), 0.0)
    return _sum_over_tp(rows, tp, sequence_parallel)


def _sum_over_tp(x: torch.Tensor, tp, sequence_parallel: bool) -> torch.Tensor:
    """The TP group's sum of x (per token): whole, or under SP this rank's shard of the tokens."""
    return comm.reduce_scatter(x, SEQ_DIM, tp) if sequence_parallel else comm.all_reduce(x, tp)


def _whole_sequence(x: torch.Tensor, tp, sequence_parallel: bool) -> torch.Tensor:
    """Every token's x from this TP rank's shard under SP (else x is whole already)."""
    return comm.all_gather(x, SEQ_DIM, tp) if sequence_parallel else x


def reduce_embedding(partial: torch.Tensor, group=None, dst: int | None = None) -> torch.Tensor:
    """The sum of every slice's rows: on every rank, or only on global rank `dst` (stage 0's)."""
    if dst is None:
        dist.all_reduce(partial, group=group)
    else:
        dist.reduce(partial, dst, group=group)
    return partial


def embedding_weight_grad(ids: torch.Tensor, grad_output: torch.Tensor, rows: int, start: int, tp=None,
                          sequence_parallel: bool = False) -> torch.Tensor:
    """EW: the gradient of this slice's rows, given the embedding output's gradient (SP: its shard)."""
    grad_output = _whole_sequence(grad_output, tp, sequence_parallel)
    local, outside = _local(ids, start, rows)
    grad = grad_output.masked_fill(outside.unsqueeze(-1), 0.0).reshape(-1, grad_output.shape[-1])
    out = torch.zeros(rows, grad_output.shape[-1], dtype=grad_output.dtype, device=grad_output.device)
    return out.index_add_(0, local.reshape(-1), grad)


# --- the output layer and its cross-entropy -------------------------------------------------------

@dataclass
class SliceStatistics:
    """What one slice's S pass leaves for the barrier and its T pass (per token: shape of targets)."""
    softmax: torch.Tensor | None  # P_j, fp32, (..., rows): the slice's own softmax (TP: this rank's rows of the
    #                               block's); None when S ran in token chunks (T recomputes it)
    max: torch.Tensor            # m_j
    sum_exp: torch.Tensor        # s_j
    target_logit: torch.Tensor   # the target's logit where it falls in the slice, else 0
    softmax_grad: torch.Tensor   # P_j W_j, fp32, like X: the input gradient's softmax share, before alpha
    target_rows: torch.Tensor    # W_j[target] where the target falls in the slice, else 0, fp32, like X
    local_targets: torch.Tensor  # targets shifted into the slice (0 outside)
    outside: torch.Tensor        # targets outside the slice


@dataclass
class Statistics:
    """The barrier's result, the same on every rank of the group."""
    loss: torch.Tensor           # per token, fp32
    alpha: torch.Tensor          # this slice's share of the softmax's normalisation, per token
    input_grad: torch.Tensor     # d loss / d X, already times the loss's gradient per token


def token_chunks(n: int, size: int) -> list[tuple[int, int]]:
    """[start, end) of each chunk of `size` tokens out of n (one chunk of all when size is 0)."""
    size = size or n
    return [(a, min(a + size, n)) for a in range(0, n, size)]


def output_s_pass(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, start: int, tp=None,
                  sequence_parallel: bool = False, chunk: int = 0) -> SliceStatistics:
    """S: the slice's logits, their statistics and its share of the input gradient (no collective
    between pipeline ranks). With TP the statistics and the shares are the block's (every TP rank's
    rows): the same statistics on each TP rank, the shares under SP this rank's shard of the tokens.
    `chunk` > 0: `chunk` tokens at a time, the slice's softmax not kept (T recomputes it)."""
    x = _whole_sequence(x, tp, sequence_parallel)
    flat, w = x.reshape(-1, x.shape[-1]), weight.float()
    local, outside = _local(targets, start, weight.shape[0])
    flat_local, flat_outside = local.reshape(-1), outside.reshape(-1)
    maxes, sums, target_logits, grads, softmaxes = [], [], [], [], []
    for a, b in token_chunks(flat.shape[0], chunk):
        logits = (flat[a:b] @ weight.t()).float()
        local_max = comm.all_reduce(logits.max(dim=-1).values, tp, op=dist.ReduceOp.MAX)
        exp = (logits - local_max.unsqueeze(-1)).exp_()
        target_logit = logits.gather(-1, flat_local[a:b].unsqueeze(-1)).squeeze(-1).masked_fill(flat_outside[a:b], 0.0)
        sum_exp, target_logit = comm.all_reduce(torch.stack([exp.sum(dim=-1), target_logit]), tp).unbind(0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        # The 1-barrier form: the input gradient's GEMM runs before the statistics are known; the barrier
        # corrects it by one scalar per token (alpha).
        grads.append(softmax @ w)
        maxes.append(local_max), sums.append(sum_exp), target_logits.append(target_logit)
        if not chunk:
            softmaxes.append(softmax)
    per_token = [torch.cat(t).reshape(targets.shape) for t in (maxes, sums, target_logits)]
    target_rows = w[local].masked_fill(outside.unsqueeze(-1), 0.0)
    shares = torch.cat([torch.cat(grads).reshape(target_rows.shape), target_rows], dim=-1)
    softmax_grad, target_rows = _sum_over_tp(shares, tp, sequence_parallel).chunk(2, dim=-1)
    softmax = softmaxes[0].reshape(*targets.shape, -1) if softmaxes else None
    return SliceStatistics(softmax, *per_token, softmax_grad, target_rows, local, outside)


def reduce_statistics(s: SliceStatistics, grad_loss: torch.Tensor | float = 1.0, group=None) -> Statistics:
    """The barrier: all-reduces of the max, then of the rescaled sum of exp and the target's logit, then
    of the input-gradient shares (each scaled by its alpha); `grad_loss` is d(final loss)/d(token loss)."""
    global_max = s.max.clone()
    dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
    scaled = s.sum_exp * (s.max - global_max).exp()
    sums = torch.stack([scaled, s.target_logit])
    dist.all_reduce(sums, group=group)
    total, target_logit = sums[0], sums[1]
    alpha = scaled / total
    # sum_j (alpha_j P_j W_j - W_j[target]): only the target's own slice has a nonzero W_j[target]
    share = alpha.unsqueeze(-1) * s.softmax_grad - s.target_rows
    dist.all_reduce(share, group=group)
    return Statistics(loss=total.log() + global_max - target_logit, alpha=alpha,
                      input_grad=share * _per_token(grad_loss, share))


def output_t_pass(s: SliceStatistics, stats: Statistics, x: torch.Tensor,
                  grad_loss: torch.Tensor | float = 1.0, tp=None, sequence_parallel: bool = False,
                  weight: torch.Tensor | None = None, chunk: int = 0) -> torch.Tensor:
    """T: the slice's weight gradient (alpha P_j - onehot_j)^T X, times the loss's gradient per token
    (SP: X gathered again from this rank's shard, as the TP head's weight gradient does). After a
    chunked S (`s.softmax` None) each chunk of `chunk` tokens recomputes its softmax from X, `weight`
    and the slice's statistics."""
    x = _whole_sequence(x, tp, sequence_parallel)
    flat = x.reshape(-1, x.shape[-1])
    alpha, local, outside = (t.reshape(-1) for t in (stats.alpha, s.local_targets, s.outside))
    scale = torch.as_tensor(grad_loss, dtype=torch.float32, device=x.device)
    scale = scale.reshape(-1) if scale.dim() else scale.expand(flat.shape[0])
    softmax = None if s.softmax is None else s.softmax.reshape(flat.shape[0], -1)
    maxes, sums = s.max.reshape(-1), s.sum_exp.reshape(-1)
    out = None
    for a, b in token_chunks(flat.shape[0], 0 if softmax is not None else chunk):
        if softmax is not None:
            grad_logits = softmax * alpha.unsqueeze(-1)
        else:  # the slice's own softmax again, exp(logits - m_j) / s_j
            grad_logits = ((flat[a:b] @ weight.t()).float() - maxes[a:b].unsqueeze(-1)).exp_()
            grad_logits.mul_((alpha[a:b] / sums[a:b]).unsqueeze(-1))
        grad_logits.scatter_add_(-1, local[a:b].unsqueeze(-1), (outside[a:b].float() - 1.0).unsqueeze(-1))
        part = (grad_logits * scale[a:b].unsqueeze(-1)).t() @ flat[a:b].float()
        out = part if out is None else out.add_(part)
    return out.to(x.dtype)


def _per_token(grad_loss, like: torch.Tensor) -> torch.Tensor:
    """The loss's gradient per token (a number, or a tensor shaped like the targets), broadcastable
    against a (..., width) tensor."""
    g = torch.as_tensor(grad_loss, dtype=like.dtype, device=like.device)
    return g.unsqueeze(-1) if g.dim() else g


# --- the barrier as point-to-point messages ------------------------------------------------------
# A pipeline runtime cannot call collectives: every rank runs its own op order, so the ranks would
# enter them in different orders. It sends each slice's statistics to the ranks that need them
# instead (pipe/plan/vocab_messages.py), and each receiver merges them here, in slice order.

def statistics_message(s: SliceStatistics) -> torch.Tensor:
    """What every T (and the loss) needs of a slice: (max, sum of exp, target's logit) per token, (..., 3)."""
    return torch.stack([s.max, s.sum_exp, s.target_logit], dim=-1)


def share_message(s: SliceStatistics) -> torch.Tensor:
    """What the loss stage's backward needs of a slice: [P_j W_j, W_j[target]] per token, (..., 2 width)."""
    return torch.cat([s.softmax_grad, s.target_rows], dim=-1)


def merge_statistics(messages: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the loss per token, alpha of every slice stacked) from every slice's statistics_message."""
    maxes, sums, target_logits = torch.stack(messages).unbind(-1)
    global_max = maxes.max(dim=0).values
    scaled = sums * (maxes - global_max).exp()
    total = scaled.sum(dim=0)
    return total.log() + global_max - target_logits.sum(dim=0), scaled / total


def merged_input_grad(alphas: torch.Tensor, shares: list[torch.Tensor],
                      grad_loss: torch.Tensor | float = 1.0) -> torch.Tensor:
    """sum_j (alpha_j P_j W_j - W_j[target]) from every slice's share_message, times the loss's gradient."""
    width = shares[0].shape[-1] // 2
    grad = sum(a.unsqueeze(-1) * s[..., :width] - s[..., width:] for a, s in zip(alphas, shares))
    return grad * _per_token(grad_loss, grad)
