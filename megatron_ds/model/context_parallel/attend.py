"""Context-parallel attention by --cp-comm-type: the one entry the attention layer calls.

The queries of a CP rank are its two chunks of the sequence, or of the open Seq1F1B segment [start, stop) (each
segment laid out on its own); its keys are those of every position up to the segment's end, on every rank.
`segments` lists the (start, stop) of the segments whose K/V the queries see, the queries' own last ((0, s) when
the sequence is whole); `extend(k, v, share)` is the open segment's K/V cache hook (None: no segment), `share` the
number of ranks a cached position is split over (C for p2p, whose cache holds the local chunks; 1 for allgather
and a2a, whose cache holds whole segments).

`core(q, k, v, start)` attends queries at positions [start, start + lq), in order, to the keys [0, lk) with
lk = start + lq (causal, within the open documents): allgather and a2a reduce to it, and the layer passes its own
(ALiBi, dropout). p2p attends by blocks (blocks.py) with the documents' ids, the ALiBi slopes and the attention
dropout (with its masks' seed, or None to draw one) it is given.
`recompute(fn, *tensors)`: selective recompute's checkpoint of the core (None: kept for backward).

a2a+p2p (Megatron-core's hierarchical CP, `levels` the inner and outer groups, by default the registered ones):
the all-to-all over the inner group's A ranks leaves each rank its head group's tokens of the A ranks, which are
the two chunks its outer rank holds of the layout over P ranks (a2a.py); the ring over the outer group then is p2p
at CP P on them, its K/V cache holding 1 / P of the positions at heads / A (`share` P), and a second all-to-all
brings the output back. Each head group draws its own dropout masks (the seed offset by its inner rank).
"""
import torch
import torch.nn.functional as F

from megatron_ds.cp_section import COMM_TYPES

from ..compile import outside_graph
from ..documents import Documents, causal_arguments, documents_attention
from ..kv_cache import queries_reversed
from .a2a import heads_to_sequence, sequence_to_heads
from .allgather import gather_sequence
from .groups import context_parallel_levels
from .layout import ContextLayout
from .ring import chunk_spans, ring_attention


def _sdpa(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, **mask, enable_gqa=q.shape[1] != k.shape[1])


def prefix_attention(q, k, v, start, sdpa=_sdpa, bias=None, recompute_documents=True):
    """Causal attention (within the open documents) of queries at [start, start + lq) to keys [0, start + lq).
    `sdpa(q, k, v, mask arguments)` and `bias(lq, lk, reversed, dtype, device)` (ALiBi, its causal part included)
    as documents.Documents.attend takes them. Off CUDA the queries go last first for the strided causal mask
    (kv_cache.py), and come back in order."""
    lq, lk = q.shape[-2], k.shape[-2]
    if lk != start + lq:
        raise ValueError(f"queries at [{start}, {start + lq}) see the keys [0, {start + lq}), got {lk} keys")
    reversed_queries = queries_reversed(q.device) and lq != lk
    if reversed_queries:
        q = q.flip(2)
    if Documents.masking:
        y = documents_attention(q, k, v, start, reversed_queries, sdpa, bias, recompute_documents)
    elif bias is not None:
        y = sdpa(q, k, v, dict(attn_mask=bias(lq, lk, reversed_queries, q.dtype, q.device)))
    else:
        y = sdpa(q, k, v, causal_arguments(lq, lk, reversed_queries, q.dtype, q.device))
    return y.flip(2) if reversed_queries else y


def _run(recompute, fn, *tensors):
    return fn(*tensors) if recompute is None or not torch.is_grad_enabled() else recompute(fn, *tensors)


@outside_graph  # a compiled layer runs its communication eagerly, between its graphs
def context_parallel_attention(q, k, v, group, comm_type, segments, core=prefix_attention, extend=None,
                               recompute=None, slopes=None, dropout=0.0, seed=None, levels=None):
    """This rank's attention output (b, heads, lq, d), in its local order, of its queries q (b, heads, lq, d) and
    keys/values k, v (b, kv heads, lq, d), RoPE already applied at their global positions."""
    layout = ContextLayout.of(group)
    start, stop = segments[-1]
    if comm_type == "p2p":
        return _p2p(q, k, v, group, segments, extend, recompute, slopes, dropout, seed)
    if comm_type == "allgather":
        if extend is None:  # recomputed, the gather runs again in backward: the layer keeps its own K/V only
            return _run(recompute, lambda q, k, v: _chunks(layout, q, *_gathered(k, v, group), start, core),
                        q, k, v)
        k, v = extend(*_gathered(k, v, group), 1)
        return _chunks(layout, q, k, v, start, core, recompute)
    if comm_type == "a2a":
        q, k, v = (sequence_to_heads(t, group) for t in (q, k, v))
        if extend is not None:
            k, v = extend(k, v, 1)
        return heads_to_sequence(_run(recompute, lambda q, k, v: core(q, k, v, start), q, k, v), group)
    if comm_type == "a2a+p2p":
        inner, outer = levels if levels is not None else context_parallel_levels()
        q, k, v = (sequence_to_heads(t, inner, outer_layout=True) for t in (q, k, v))
        head_group = ContextLayout.of(inner).rank
        if dropout and seed is None:  # drawn here, not in the ring: the offset applies to it
            seed = int(torch.randint(0, 2 ** 62, (1,), device=q.device).item())
        seed = None if seed is None else (seed + head_group) % 2 ** 62
        y = _p2p(q, k, v, outer, segments, extend, recompute, slopes, dropout, seed)
        return heads_to_sequence(y, inner, outer_layout=True)
    raise ValueError(f"--cp-comm-type {comm_type!r}: choose one of {', '.join(COMM_TYPES)}")


def _p2p(q, k, v, group, segments, extend, recompute, slopes, dropout, seed):
    """The ring over `group`, whose ranks hold the layout's chunks of the open segment (and cache theirs of the
    earlier ones)."""
    layout = ContextLayout.of(group)
    start, stop = segments[-1]
    if extend is not None:
        k, v = extend(k, v, layout.size)
    documents = Documents.current() if Documents.masking else None
    query_spans = chunk_spans(layout, stop - start, start)
    key_spans = [[span for a, b in segments for span in chunk_spans(layout, b - a, a, r)]
                 for r in range(layout.size)]
    def ring(q, k, v):  # recomputed, it draws its dropout seed again from the restored RNG state
        return ring_attention(q, k, v, group, query_spans, key_spans, documents, slopes, dropout=dropout, seed=seed)
    return _run(recompute, ring, q, k, v)


def _gathered(k, v, group):
    return gather_sequence(k, group), gather_sequence(v, group)


def _chunks(layout, q, k, v, start, core, recompute=None):
    """Each local query chunk attended to the keys of its prefix (k, v: positions [0, stop) in global order)."""
    half = q.shape[2] // 2
    outs = []
    for i, chunk in enumerate(layout.chunks()):
        first = start + chunk * half
        q_chunk, k_prefix, v_prefix = q[:, :, i * half:(i + 1) * half], k[:, :, :first + half], v[:, :, :first + half]
        outs.append(_run(recompute, lambda q, k, v, first=first: core(q, k, v, first), q_chunk, k_prefix, v_prefix))
    # laid out (b, s, heads, d), as SDPA lays out its output: the layer's reshape for c_proj is a view of it
    return torch.cat([out.transpose(1, 2) for out in outs], dim=1).transpose(1, 2)
