"""Ring attention (--cp-comm-type p2p): each rank's K/V pass around the CP group while the block in hand is attended.

Step t of C, rank r holds the keys/values of rank r - t (its own at t = 0) and posts, before attending them, their
send to r + 1 and the receive of r - t - 1's from r - 1 (one message: keys and values stacked). Every (query chunk,
key chunk) pair is classified by global positions and the documents' starts (blocks.py): the blocks above the causal
diagonal, or split from the queries by a document border, are skipped, those below attended without a mask, and the
rest under a mask of positions (and documents). The blocks' outputs
merge by their log-sum-exp in fp32 (online softmax). The layer keeps q, k, v, the output and the log-sum-exp; the
output is (b, heads, s, d) over (b, s, heads, d) memory, so the output projection's input is the same storage.

Backward is a ring too: the keys/values travel as in forward, and with them the gradients of a block's keys and
values, to which each rank adds its queries' share before sending them on; after C steps they are back with their
owner. A step attends its block into a fresh gradient buffer while the previous step's gradient block travels,
and only then waits for the sum that arrived, adds it and posts the whole on: C - 1 gradient transfers run under
the next step's block compute, the last (home to the owner) after it. The probabilities are recomputed from the
saved log-sum-exp, block by block.

A rank's keys may be more than its chunks of one sequence: under Seq1F1B they are its local K/V cache, the chunks
of every segment so far (`key_spans`: the same on every rank, as every rank holds the same number of positions).
Cost per layer: C - 1 sends of the local K/V forward; C - 1 of them and C of their gradients (fp32) backward; no
rank ever holds more than two blocks of K/V, nor more than three of their gradients (the one attended into, the
one in flight out, the one arriving; at C = 2 the step with three holds one K/V block): a block sent is let go
of once its wait returns (a finished work still holds its tensors), a gradient block received once it is added.
"""
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .blocks import NONE, SOME, Span, alibi_block, block_backward, block_forward, block_mask, dropout_keep, merge, \
    repeat_kv, sum_groups, visibility
from ..tensor_parallel.comm import CommCounter
from .layout import ContextLayout

_KV_TAG, _GRAD_TAG = 1, 2  # distinct tags: a block's K/V and its gradients may be in flight to one peer at once
TILE = 1024  # positions: chunks longer are attended in tiles, so a block's scores are at most b x heads x TILE^2


def chunk_spans(layout: ContextLayout, length: int, start: int = 0, rank: int | None = None) -> list[Span]:
    """The spans of the two chunks `rank` holds of a sequence (or Seq1F1B segment) of `length` tokens from
    position `start`, in local order."""
    half = layout.local_length(length) // 2
    return [Span(start + chunk * half, half) for chunk in layout.chunks(rank)]


@dataclass(frozen=True)
class RingPlan:
    """What a ring attends: the group, the spans of this rank's queries (local order), each rank's key spans
    (local order; every rank's the same total length), the softmax scale, the documents' ids (b, s) of the whole
    sequence and each row's document starts (host integers) or None, this rank's heads' ALiBi slopes or None, and
    the attention dropout with the seed of its masks (blocks.dropout_keep)."""
    group: object
    layout: ContextLayout
    query_spans: tuple
    key_spans: tuple  # per rank: tuple of Spans
    scale: float
    ids: object = None
    starts: object = None
    slopes: object = None
    dropout: float = 0.0
    seed: int = 0

    def blocks(self, src, q):
        """(query slice, key slice, mask, bias, dropout mask) of every block of this rank's queries q and `src`'s
        keys that sees anything."""
        device = q.device
        q_offset = 0
        for qs in tiles(self.query_spans):
            k_offset = 0
            for ks in tiles(self.key_spans[src]):
                seen = visibility(qs, ks, self.starts)
                if seen != NONE:
                    mask = block_mask(qs, ks, self.ids, device) if seen == SOME else None
                    bias = None if self.slopes is None else alibi_block(self.slopes, qs, ks, device)
                    keep = None
                    if self.dropout:
                        shape = (q.shape[0], q.shape[1], qs.length, ks.length)
                        keep = dropout_keep(self.seed, qs, ks, shape, self.dropout, device)
                    yield (slice(q_offset, q_offset + qs.length), slice(k_offset, k_offset + ks.length), mask, bias,
                           keep)
                k_offset += ks.length
            q_offset += qs.length


def tiles(spans):
    """The spans cut into pieces of at most TILE positions, in order."""
    return [Span(span.start + i, min(TILE, span.length - i)) for span in spans for i in range(0, span.length, TILE)]


def _exchange(t, plan, tag):
    """Post the send of t to the next rank and the receive of the previous rank's: (received, works)."""
    size, rank = plan.layout.size, plan.layout.rank
    received = torch.empty_like(t)
    CommCounter.record("cp_send", t)
    ops = [dist.P2POp(dist.isend, t, dist.get_global_rank(plan.group, (rank + 1) % size), plan.group, tag),
           dist.P2POp(dist.irecv, received, dist.get_global_rank(plan.group, (rank - 1) % size), plan.group, tag)]
    return received, dist.batch_isend_irecv(ops)


def _wait(works):
    for work in works:
        work.wait()


class _Ring(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, plan):
        heads, size, rank = q.shape[1], plan.layout.size, plan.layout.rank
        qf = q.float()
        b, _, s, d = q.shape
        # laid out (b, s, heads, d), as SDPA lays out its output: the layer's transpose back to tokens and the
        # reshape for c_proj are views of it, and c_proj keeps the tensor this node keeps, not a copy of it
        out = torch.zeros((b, s, heads, d), dtype=torch.float32, device=q.device).transpose(1, 2)
        lse = torch.full(qf.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack((k, v)).contiguous()
        for step in range(size):
            if step < size - 1:
                incoming, works = _exchange(kv, plan, _KV_TAG)
            kf, vf = repeat_kv(kv[0].float(), heads), repeat_kv(kv[1].float(), heads)
            for qs, ks, mask, bias, keep in plan.blocks((rank - step) % size, q):
                o, l = block_forward(qf[:, :, qs], kf[:, :, ks], vf[:, :, ks], plan.scale, mask, bias, keep)
                out[:, :, qs], lse[:, :, qs] = merge(out[:, :, qs], lse[:, :, qs], o, l)
            if step < size - 1:
                _wait(works)
                kv, works = incoming, None  # a finished work still holds the block it sent: let go of it now
        y = out.to(q.dtype)
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, y, lse)
        return y

    @staticmethod
    def backward(ctx, dy):
        q, k, v, y, lse = ctx.saved_tensors
        plan = ctx.plan
        heads, kv_heads, size, rank = q.shape[1], k.shape[1], plan.layout.size, plan.layout.rank
        qf, dyf = q.float(), dy.float()
        delta = (dyf * y.float()).sum(-1)
        dq = torch.zeros_like(qf)
        kv = torch.stack((k, v)).contiguous()
        # (received, works, sent): the gradient sum of the K/V in hand from the ranks that held them before; the sent
        # buffer is held until its send is waited for, so no allocator hands its memory out while it travels
        arriving = None
        for step in range(size):
            if step < size - 1:
                incoming, works = _exchange(kv, plan, _KV_TAG)
            # this step's share goes into a fresh buffer, so the previous step's gradient block travels meanwhile
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=k.device)
            kf, vf = repeat_kv(kv[0].float(), heads), repeat_kv(kv[1].float(), heads)
            for qs, ks, mask, bias, keep in plan.blocks((rank - step) % size, q):
                dq_b, dk_b, dv_b = block_backward(qf[:, :, qs], kf[:, :, ks], vf[:, :, ks], dyf[:, :, qs],
                                                  delta[:, :, qs], lse[:, :, qs], plan.scale, mask, bias, keep)
                dq[:, :, qs] += dq_b
                dkv[0][:, :, ks] += sum_groups(dk_b, kv_heads)
                dkv[1][:, :, ks] += sum_groups(dv_b, kv_heads)
            if arriving is not None:
                _wait(arriving[1])
                dkv += arriving[0]
                arriving = None  # the sum is in dkv and the block sent has left: both freed before the next arrives
            arriving = (*_exchange(dkv, plan, _GRAD_TAG), dkv)  # on to the next holder; after the last step, the owner
            if step < size - 1:
                _wait(works)
                kv, works = incoming, None
        _wait(arriving[1])  # the own K/V's sum, home after C sends: the one transfer no block compute hides
        dkv = arriving[0]
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


def ring_attention(q, k, v, group, query_spans, key_spans, documents=None, slopes=None, scale=None, dropout=0.0,
                   seed=None):
    """Causal attention (within `documents`' documents, a Documents of the whole sequence, when given) of this rank's
    queries q (b, heads, lq, d) at `query_spans` to the keys/values k, v (b, kv heads, lk, d) of every rank of the
    CP `group`, rank r's at key_spans[r]. `slopes`: this rank's heads' ALiBi slopes, or None. `dropout`: of the
    attention probabilities, its masks drawn from `seed` (None: one drawn from q's device's generator; a recomputed
    call, whose RNG state is restored, draws the same)."""
    ids, starts = (documents.ids, documents.starts) if documents is not None else (None, None)
    if dropout and seed is None:
        seed = int(torch.randint(0, 2 ** 62, (1,), device=q.device).item())
    plan = RingPlan(group, ContextLayout.of(group), tuple(query_spans), tuple(tuple(s) for s in key_spans),
                    scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]), ids, starts, slopes, dropout,
                    seed or 0)
    return _Ring.apply(q, k, v, plan)
