"""Attention of a block of queries to a block of keys, with the log-sum-exp that merges blocks (ring attention).

A block is a run of consecutive global positions (a chunk of the 2 x CP layout, or of a Seq1F1B segment's
layout): `Span(start, length)`. Visibility is defined by global positions: query i sees key j iff j <= i, and,
with packed documents, both are in the same document. A (query span, key span) pair is classified on the host
from the spans (and the documents' starts) alone (`visibility`): every key visible (no mask), none (skipped: the
causal blocks above the diagonal, and blocks whose keys all end their documents before the queries' begin), or some
(a boolean mask made of the positions, and of the documents' ids at them).

Forward returns the block's softmax-weighted values and the log-sum-exp of its scores (fp32): blocks of the
same queries merge exactly (`merge`), as flash attention's online softmax does. Attention dropout drops the
normalised probabilities: a block's `keep` mask (`dropout_keep`: drawn from a generator seeded by the call's seed
and the block's global spans, so backward draws it again, and it does not depend on which rank attends the block)
scales the block's probabilities by keep / (1 - p) after the log-sum-exp, which stays that of the undropped scores. Backward recomputes a block's
probabilities from q, k and the merged log-sum-exp (`block_backward`), so a ring keeps only q, k, v, the output
and the log-sum-exp. Arithmetic is fp32 whatever the inputs' dtype; K/V heads fewer than query heads (GQA) are
repeated for the block and their gradients summed back over each group.
"""
import bisect
from dataclasses import dataclass

import torch

ALL, SOME, NONE = "all", "some", "none"


@dataclass(frozen=True)
class Span:
    """Consecutive global positions [start, start + length)."""
    start: int
    length: int

    @property
    def stop(self):
        return self.start + self.length

    def positions(self, device=None):
        return torch.arange(self.start, self.stop, device=device)


def visibility(queries: Span, keys: Span, starts=None) -> str:
    """ALL (no mask), NONE (skip) or SOME (mask) of `keys` visible to `queries`, causally and, with `starts` (each
    row's sorted document starts: Documents.starts, host integers), within documents: NONE where every row has a
    document start between the last key and the first query, ALL where no row has one after the first key."""
    if keys.start > queries.stop - 1:
        return NONE
    if starts is not None:
        if all(_starts_within(row, keys.stop, queries.start) for row in starts):
            return NONE
        if any(_starts_within(row, keys.start + 1, queries.stop - 1) for row in starts):
            return SOME
    return ALL if keys.stop - 1 <= queries.start else SOME


def _starts_within(starts, low, high):
    """Whether a document starts at a position in [low, high]."""
    i = bisect.bisect_left(starts, low)
    return i < len(starts) and starts[i] <= high


def block_mask(queries: Span, keys: Span, ids=None, device=None):
    """(b or 1, 1, lq, lk) booleans: key visible to query; `ids` (b, s) the documents' ids of the whole sequence."""
    qpos, kpos = queries.positions(device), keys.positions(device)
    allowed = (kpos <= qpos.unsqueeze(-1)).unsqueeze(0)
    if ids is not None:
        allowed = allowed & (ids[:, qpos].unsqueeze(-1) == ids[:, kpos].unsqueeze(-2))
    return allowed.unsqueeze(1)


def alibi_block(slopes, queries: Span, keys: Span, device=None):
    """ALiBi's additive bias (heads, lq, lk) of the block: -slope x (query position - key position)."""
    distance = (queries.positions(device).unsqueeze(-1) - keys.positions(device)).float()
    return -slopes.float()[:, None, None] * distance


def dropout_keep(seed, queries: Span, keys: Span, shape, p, device=None):
    """The block's dropout mask, keep / (1 - p) (fp32, `shape` (b, heads, lq, lk)): the same for the same seed and
    spans wherever it is drawn."""
    generator = torch.Generator(device=device)
    generator.manual_seed((seed * 1_000_003 + queries.start * 65_537 + keys.start) % (2 ** 63))
    keep = torch.rand(shape, generator=generator, device=device) >= p
    return keep.float() / (1.0 - p)


def repeat_kv(t, heads):
    """(b, kv heads, s, d) -> (b, heads, s, d): each K/V head repeated for its group of query heads (SDPA's
    enable_gqa order)."""
    groups = heads // t.shape[1]
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def sum_groups(t, kv_heads):
    """The gradient of repeat_kv: (b, heads, s, d) -> (b, kv heads, s, d)."""
    b, heads, s, d = t.shape
    return t if heads == kv_heads else t.view(b, kv_heads, heads // kv_heads, s, d).sum(2)


def _scores(q, k, scale, mask, bias):
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return s


def _finite(lse):
    """lse with the rows that see no key (-inf) at 0, so that exp(scores - lse) is 0 there, never NaN."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def block_forward(q, k, v, scale, mask=None, bias=None, keep=None):
    """(out (b, heads, lq, d), lse (b, heads, lq)) in fp32 of q (fp32, b, heads, lq, d) to k, v (fp32, already
    repeated to `heads`); `keep`: the block's dropout mask (dropout_keep) or None. A row that sees no key has lse
    -inf and out 0."""
    s = _scores(q, k, scale, mask, bias)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - _finite(lse).unsqueeze(-1))
    return torch.matmul(p if keep is None else p * keep, v), lse


def merge(out, lse, block_out, block_lse):
    """The softmax over the union of two key sets from each one's (out, lse): (out, lse), fp32."""
    new = torch.logaddexp(lse, block_lse)
    safe = _finite(new).unsqueeze(-1)
    return out * torch.exp(lse.unsqueeze(-1) - safe) + block_out * torch.exp(block_lse.unsqueeze(-1) - safe), new


def block_backward(q, k, v, dout, delta, lse, scale, mask=None, bias=None, keep=None):
    """Gradients (dq, dk, dv), fp32, of one block given the gradient of the merged output `dout`, the merged
    log-sum-exp `lse` and delta = rowsum(dout x out): the block's probabilities recomputed, p = exp(s - lse), and
    its dropout mask `keep` (the forward's) applied to them and to their gradient."""
    p = torch.exp(_scores(q, k, scale, mask, bias) - _finite(lse).unsqueeze(-1))
    dv = torch.matmul((p if keep is None else p * keep).transpose(-1, -2), dout)
    dp = torch.matmul(dout, v.transpose(-1, -2))
    ds = p * ((dp if keep is None else dp * keep) - delta.unsqueeze(-1))
    return torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-1, -2), q) * scale, dv
