"""The block attention under ring attention (context_parallel/blocks.py), on one process: the classification of
(query span, key span) pairs never skips a visible key nor leaves out a mask it needs (checked against the explicit
mask for every pair of spans over packed rows), and blocks merged by their log-sum-exp, and their recomputed
gradients, equal attention over all the keys at once (fp64, within 1e-12)."""
import itertools

import torch
import torch.nn.functional as F

from megatron_ds.model.context_parallel.blocks import ALL, NONE, SOME, Span, block_backward, block_forward, \
    block_mask, merge, repeat_kv, sum_groups, visibility
from megatron_ds.model.documents import Documents

EOD = 0


def test_visibility_agrees_with_the_explicit_mask():
    tokens = torch.randint(1, 9, (3, 24), generator=torch.Generator().manual_seed(0))
    tokens[0, [3, 11, 12]] = EOD
    tokens[1, [11]] = EOD
    tokens[2, [2, 11, 19]] = EOD
    documents = Documents(tokens, EOD)
    spans = [Span(a, n) for a in range(0, 24, 2) for n in (2, 4) if a + n <= 24]
    seen = set()
    for queries, keys in itertools.product(spans, spans):
        for starts, ids in ((None, None), (documents.starts, documents.ids)):
            kind = visibility(queries, keys, starts)
            mask = block_mask(queries, keys, ids)
            seen.add((kind, starts is None))
            if kind == NONE:
                assert not mask.any(), (queries, keys, starts is None)
            elif kind == ALL:
                assert mask.all(), (queries, keys, starts is None)
            elif starts is None:  # causal alone: SOME only where the causal mask cuts the block
                assert mask.any() and not mask.all(), (queries, keys)
    assert {(k, causal) for k in (ALL, NONE, SOME) for causal in (True, False)} == seen  # every kind occurs


def test_merged_blocks_and_their_gradients_equal_attention_over_all_keys():
    g = torch.Generator().manual_seed(1)
    b, heads, kv_heads, lq, lk, d = 2, 4, 2, 6, 12, 8
    q, dy = torch.randn(b, heads, lq, d, generator=g, dtype=torch.float64), \
        torch.randn(b, heads, lq, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(b, kv_heads, lk, d, generator=g, dtype=torch.float64) for _ in range(2))
    queries = Span(6, lq)  # the last lq of lk positions: the causal diagonal inside the last key block
    blocks = [Span(0, 4), Span(4, 4), Span(8, 4)]
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    mask = block_mask(queries, Span(0, lk))
    y = F.scaled_dot_product_attention(*ref, attn_mask=mask, enable_gqa=True)
    y.backward(dy)

    scale = d ** -0.5
    kr, vr = repeat_kv(k, heads), repeat_kv(v, heads)
    out, lse = torch.zeros_like(q), torch.full(q.shape[:3], float("-inf"), dtype=q.dtype)
    for keys in blocks:
        part = slice(keys.start, keys.stop)
        o, l = block_forward(q, kr[:, :, part], vr[:, :, part], scale, block_mask(queries, keys))
        out, lse = merge(out, lse, o, l)
    assert (out - y.detach()).abs().max() < 1e-12
    delta = (dy * out).sum(-1)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(kr), torch.zeros_like(vr)
    for keys in blocks:
        part = slice(keys.start, keys.stop)
        dq_b, dk_b, dv_b = block_backward(q, kr[:, :, part], vr[:, :, part], dy, delta, lse, scale,
                                          block_mask(queries, keys))
        dq += dq_b
        dk[:, :, part] += dk_b
        dv[:, :, part] += dv_b
    for got, want in ((dq, ref[0].grad), (sum_groups(dk, kv_heads), ref[1].grad), (sum_groups(dv, kv_heads),
                                                                                  ref[2].grad)):
        assert (got - want).abs().max() < 1e-12
