"""Our attention, registered in transformers' attention interface: a Hugging Face decoder layer cut out of its
model calls it in place of the model's own.

The model's forward makes one attention mask for all its layers; a layer run alone on a pipeline stage has no
such mask, only the position ids that travel with the hidden states. So the mask is made here, per call, from
the position ids: causal, a new document wherever the positions do not go on by one (packed documents, as
transformers' own find_packed_sequence_indices reads them), and the layer's sliding window when it has one.
A mask the caller did make (the whole model's forward under this implementation) is used as given.

Seq1F1B: a segment's queries see the keys of every earlier position in the engine's K/V cache; with packed
documents, only those of their own document, which the segment's position ids alone cannot say (a document may
have begun in an earlier segment). So the engine opens the micro-batch's documents, read from its whole position
ids (PositionDocuments, model/documents.py's Documents), around each op, as it opens our GPT's.

Context parallelism: while the engine has a context-parallel group open (`context_parallel`), a rank holds its two
chunks of the sequence (or of the open segment) and the model's rotary has rotated them by the position ids of
those tokens; the attention is model/context_parallel's (attend.py: ring p2p, allgather or a2a), causal by the
tokens' places in the sequence and within the open documents. Sliding windows and capped scores are not in it and
are refused.
"""
import contextlib

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from megatron_ds.errors import UserError
from megatron_ds.model.context_parallel import ContextLayout
from megatron_ds.model.context_parallel.attend import context_parallel_attention
from megatron_ds.model.documents import Documents
from megatron_ds.model.kv_cache import KVSlot, SegmentKVCache

NAME = "megatron_ds"


class AttentionError(UserError):
    pass


def documents(position_ids):
    """[b, s] document index of each token: a document starts wherever the position is not the last one + 1."""
    step = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
    return (step != 1).cumsum(-1)


def starts(position_ids):
    """[b, s] booleans: a document starts at the token (the first one, and wherever the positions do not go on)."""
    first = torch.ones_like(position_ids, dtype=torch.bool)
    first[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return first


class PositionDocuments(Documents):
    """A micro-batch's documents as our attention code reads them (Documents: each token's document id, each row's
    document starts), found from its whole position ids rather than from end-of-document tokens."""

    def __init__(self, position_ids):
        first = starts(position_ids)
        self.ids = first.cumsum(dim=1, dtype=torch.int32) - 1
        self.positions = None  # the model's rotary rotates by the position ids themselves
        self.starts = [row.nonzero().flatten().tolist() for row in first.cpu()]
        self._masks, self._groups, self._tables = {}, {}, {}  # Documents' memos, which its __init__ would make

    @classmethod
    def of(cls, position_ids):
        """The documents of `position_ids` [b, s], or None when every row is one document."""
        return cls(position_ids) if bool(starts(position_ids)[:, 1:].any()) else None


def mask_from_positions(position_ids, length, window=None):
    """[b, 1, s, s] boolean mask (True: attend) of causal attention within documents and within `window` tokens
    back; None when plain causal attention is that mask (one document a row, no window that bites)."""
    if position_ids is None:
        position_ids = torch.arange(length).unsqueeze(0)
    docs = documents(position_ids)
    packed = bool((docs[:, -1] != 0).any())
    if not packed and (window is None or window >= length):
        return None
    idx = torch.arange(length, device=position_ids.device)
    allowed = idx[None, :] <= idx[:, None]
    if window is not None:
        allowed = allowed & (idx[:, None] - idx[None, :] < window)
    allowed = allowed[None] & (docs[:, :, None] == docs[:, None, :])
    return allowed[:, None]


def _slot(module):
    """The attention module's place in the segment K/V cache (a plain attribute: not a submodule or buffer)."""
    slot = module.__dict__.get("_megatron_kv_slot")
    if slot is None:
        slot = module.__dict__["_megatron_kv_slot"] = KVSlot()
    return slot


def segment_mask(position_ids, offset, queries, keys, window=None, device=None):
    """Mask (True: attend) of a Seq1F1B segment, [queries, keys], or [b, 1, queries, keys] within the open documents:
    query i is position offset + i, which sees keys [0, offset + i] (within `window` back, and of its document).
    Without open documents the segment's position ids must go on from the offset: a document restarting in it
    would need the earlier segments' positions, which the engine's documents hold."""
    q = torch.arange(offset, offset + queries, device=device)[:, None]
    k = torch.arange(keys, device=device)[None, :]
    allowed = k <= q
    if window is not None:
        allowed = allowed & (q - k < window)
    if Documents.masking:
        ids = Documents.current().ids
        return (allowed & (ids[:, offset:offset + queries, None] == ids[:, None, :keys]))[:, None]
    if position_ids is not None and not bool((position_ids == q.T).all()):
        raise AttentionError("packed documents (position ids restarting) in Seq1F1B's segments without the "
                             "micro-batch's documents open: run the model through pipe.hf.engine.build_engine, "
                             "whose engine opens them")
    return allowed


_CONTEXT = None  # (group, comm type) of the op the engine runs under context parallelism, None outside one


@contextlib.contextmanager
def context_parallel(group, comm_type):
    """Our attention runs context-parallel over `group` by `comm_type` (--cp-comm-type) inside; nothing to open
    with `group` None."""
    global _CONTEXT
    previous = _CONTEXT
    _CONTEXT = None if group is None else (group, comm_type)
    try:
        yield
    finally:
        _CONTEXT = previous


def _context_parallel(module, query, key, value, dropout, scaling, window, segment):
    """This rank's attention output [b, heads, s / CP, d] of its chunks, over the open context-parallel group."""
    group, comm_type = _CONTEXT
    length = segment.total if segment is not None else query.shape[2] * ContextLayout.of(group).size
    if window is not None and window < length:
        raise AttentionError(f"{type(module).__name__}: a sliding window ({window} tokens) under context "
                             "parallelism: the context-parallel attention has no window; run without "
                             "--context-parallel-size")
    d = query.shape[-1]
    if scaling is not None and scaling != d ** -0.5:  # the CP attention scales by 1 / sqrt(d)
        query = query * (scaling * d ** 0.5)
    extend = None
    if segment is not None:
        def extend(k, v, share):
            return segment.extend(_slot(module), k, v, share)
    spans = segment.spans if segment is not None else ((0, length),)
    return context_parallel_attention(query, key, value, group, comm_type, spans, extend=extend, dropout=dropout)


def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention-interface signature: query [b, h, s, d], key/value [b, h_kv, s, d] ->
    ([b, s, h, d], no weights)."""
    if kwargs.get("s_aux") is not None:
        raise AttentionError(f"{type(module).__name__}: attention sinks (s_aux) are not in megatron_ds's attention; "
                             "this model cannot be cut into pipeline stages yet")
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    segment = SegmentKVCache.current() if SegmentKVCache.opened else None
    if _CONTEXT is not None:
        if kwargs.get("softcap") is not None:
            raise AttentionError(f"{type(module).__name__}: capped attention scores (softcap) under context "
                                 "parallelism: the context-parallel attention does not cap them")
        out = _context_parallel(module, query, key, value, dropout, scaling, window, segment)
        return out.transpose(1, 2).contiguous(), None
    mask = attention_mask
    if segment is not None:  # Seq1F1B: this segment's queries over the keys of every position up to its end
        key, value = segment.extend(_slot(module), key, value)
        mask = segment_mask(kwargs.get("position_ids"), segment.offset, query.shape[2], key.shape[2], window,
                            query.device)
    if mask is None and segment is None:
        mask = mask_from_positions(kwargs.get("position_ids"), query.shape[2], window)
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(~mask, float("-inf"))
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    softcap = kwargs.get("softcap")
    if softcap is None:  # K/V stay grouped (enable_gqa): no copy of them for each query head of a group
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout,
                                             is_causal=mask is None and query.shape[2] > 1, scale=scale,
                                             enable_gqa=query.shape[1] != key.shape[1])
    else:
        out = _capped(query, key, value, mask, dropout, scale, softcap)
    return out.transpose(1, 2).contiguous(), None


def _capped(query, key, value, mask, dropout, scale, softcap):
    """Attention whose scores are capped before the mask and softmax (Gemma 2's). A K/V head's group of query heads
    is one more batch dimension of the products, against the head broadcast: no copy of K/V per query head."""
    b, heads, n, d = query.shape
    kv = key.shape[1]
    grouped = query.view(b, kv, heads // kv, n, d)
    scores = (grouped @ key.unsqueeze(2).transpose(3, 4)).view(b, heads, n, key.shape[2])
    scores = torch.tanh(scores * scale / softcap) * softcap
    if mask is None:
        mask = torch.full((n, n), float("-inf"), dtype=query.dtype, device=query.device).triu(1)
    probs = torch.softmax(scores + mask, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = F.dropout(probs, p=dropout, training=dropout > 0)
    return (probs.view(b, kv, heads // kv, n, -1) @ value.unsqueeze(2)).view(b, heads, n, d)


def register():
    """Make NAME an attention implementation (and its mask, for the whole model's forward) in transformers."""
    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
