"""Packed documents: Megatron's --reset-position-ids, --reset-attention-mask and --eod-mask-loss.

A pretraining sample packs documents end to end, each ended by the end-of-document token (EOD). The EOD
belongs to the document it ends; the next token starts a new one. With the flags (Megatron's
get_ltor_masks_and_position_ids, same meaning):
- reset_position_ids: positions restart at 0 after each EOD (the learned position embedding, and here RoPE
  too, where Megatron rotates by the index: RoPE's scores depend on position differences only, so within a
  document the two differ by rounding, and a document scores as it would alone);
- reset_attention_mask: a token attends to the earlier tokens of its own document only;
- eod_mask_loss: the prediction made at an EOD input (the next document's first token, which nothing in the
  document can know) is not scored: its label becomes IGNORE, and the loss is the mean over the others.

`Packing` (from a GPTConfig) makes a batch's positions and labels, and a micro-batch's `Documents`. The
runtime opens a micro-batch's Documents around each op that runs its layers (`with documents.opened():`, as
it opens a Seq1F1B segment of the K/V cache); attention reads `Documents.current()`.

Attention without an (s x s) mask. A document mask is block-diagonal causal. Where a row's (queries x keys)
is at most DENSE_SIDE^2 the whole batch takes one boolean mask (cheaper than a kernel per document). Longer,
each row's documents are gathered into groups: consecutive documents whose keys span at most DENSE_SIDE
positions attend together under a small mask of their own, and a longer document alone, causally, with no
mask at all (is_causal, or bottom-right aligned when its keys start in an earlier Seq1F1B segment). Every
group writes its rows of one output tensor, and the groups run under a checkpoint: attended again in backward,
they keep no output of their own beside it. A Seq1F1B segment's queries [start, stop) see the keys [0, stop)
of the K/V cache: every stage holds the whole micro-batch's tokens, so the document of every cached key is
known without caching anything more.
"""
import bisect
import contextlib
import functools

import torch
from torch.utils.checkpoint import checkpoint

from .compile import outside_graph
from .kv_cache import reversed_causal_mask
from .positions import rope_tables, rope_tables_at

IGNORE = -100  # a label no loss scores (F.cross_entropy's ignore_index)
DENSE_SIDE = 512  # one mask up to this many queries x keys per row, squared (a group's keys span at most this): below
# it a kernel per document would cost more than scoring what the mask drops (a choice, not yet timed on a GPU)


class Packing:
    """What a run does with its packed documents (a GPTConfig's flags and EOD token)."""

    def __init__(self, config):
        if config.eod_token is None:
            raise ValueError("--reset-position-ids, --reset-attention-mask and --eod-mask-loss need the tokenizer's "
                             "end-of-document token (GPTConfig.eod_token)")
        self.eod = config.eod_token
        self.reset_position_ids, self.reset_attention_mask = config.reset_position_ids, config.reset_attention_mask
        self.eod_mask_loss = config.eod_mask_loss
        self.rope = config.position_embedding_type == "rope"
        self.every_stage = config.documents_in_every_stage

    @classmethod
    def of(cls, config):
        """The run's Packing, or None when no document flag is on."""
        return cls(config) if config.packs_documents else None

    def positions(self, tokens):
        """Position ids (b, s): each token's distance from its document's first token, or its index."""
        index = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        if not self.reset_position_ids:
            return index
        return index - torch.where(_starts(tokens, self.eod), index, 0).cummax(dim=1).values

    def labels(self, tokens, labels):
        """The labels, IGNORE where the input is an EOD under eod_mask_loss."""
        return labels.masked_fill(tokens == self.eod, IGNORE) if self.eod_mask_loss else labels

    def batch(self, tokens, labels):
        """A micro-batch ((tokens, position_ids), labels) of packed inputs and their next tokens."""
        return (tokens, self.positions(tokens)), self.labels(tokens, labels)

    def documents(self, tokens, position_ids):
        """The micro-batch's Documents when its layers need them (else None)."""
        if not self.every_stage:
            return None
        positions = position_ids if self.reset_position_ids and self.rope else None
        return Documents(tokens, self.eod, positions, self.reset_attention_mask)


def _starts(tokens, eod):
    """(b, s) booleans: the first token of a document (position 0, and each token after an EOD)."""
    starts = torch.ones_like(tokens, dtype=torch.bool)
    starts[:, 1:] = tokens[:, :-1] == eod
    return starts


class Documents:
    """One micro-batch's documents: each position's document number `ids` (b, s) when attention masks by
    document, the restarted `positions` (b, s) when RoPE rotates by them, and each row's document starts
    (host integers: the attention groups are planned once per op, not per layer)."""
    _open = None  # the Documents of the op the runtime runs, None outside one
    masking = False  # attention masks by document (read by a compiled layer: a flag, not the object)
    positioning = False  # RoPE rotates by the documents' positions

    def __init__(self, tokens, eod, positions=None, mask=True):
        starts = _starts(tokens, eod)
        self.ids = (starts.cumsum(dim=1, dtype=torch.int32) - 1) if mask else None
        self.positions = positions
        self.starts = [row.nonzero().flatten().tolist() for row in starts.cpu()] if mask else None
        self._masks, self._groups = {}, {}  # memos per (rows, queries, keys): every layer of an op shares them
        self._tables = {}  # the op's RoPE tables of its positions, a memo as the masks (its layers share them)

    def to(self, device):
        """Its tensors on `device` (in place: the host starts stay)."""
        self.ids = None if self.ids is None else self.ids.to(device)
        self.positions = None if self.positions is None else self.positions.to(device)
        return self

    @classmethod
    def current(cls):
        return cls._open

    @classmethod
    def make_current(cls, documents):
        """`documents` (or None) open from now on, with the flags compiled layers read; outside `opened`, the
        overlapped unit's hand-over swaps each side's in (pipe/moe/overlap.py)."""
        cls._open = documents
        _set_flags(documents)

    @contextlib.contextmanager
    def opened(self):
        """The documents of the op about to run; its masks go when it ends (a micro-batch waiting for its next
        op holds none: the host plan of its groups is all it keeps)."""
        previous = Documents._open
        Documents.make_current(self)
        try:
            yield self
        finally:
            Documents.make_current(previous)
            self._masks.clear()
            self._tables.clear()

    def rope_positions(self, start, length):
        return self.positions[:, start:start + length]

    def rope_tables_at(self, head_dim, theta, layout, length, start, device, dtype, scaling=None):
        """cos and sin (b, 1, n, head_dim) of the restarted positions of the tokens a context-parallel rank holds
        (context_parallel_rope_tables), made once per op: its tokens are not consecutive, and the documents hold
        the whole sequence."""
        return self.tables((head_dim, theta, layout, length, start, device, dtype, scaling),
                           lambda: rope_tables_at(head_dim, theta, self.positions[:, layout.positions(
                               length, start, device=device)], dtype, scaling))

    def tables(self, key, make):
        """The op's RoPE tables under `key`, make() the first time in the op."""
        if key not in self._tables:
            self._tables[key] = make()
        return self._tables[key]

    def attend(self, q, k, v, start, reversed_queries, sdpa, bias=None, recompute=True):
        """Attention of queries q (b, heads, lq, d) at positions [start, start + lq) (last first when
        `reversed_queries`) to keys k, v (b, kv heads, lk, d) at [0, lk), lk = start + lq, within each document.
        `sdpa(q, k, v, mask)` runs scaled_dot_product_attention with the mask arguments `mask`; `bias(lq, lk,
        reversed, dtype, device)`: an additive (heads, lq, lk) bias whose causal part is included (ALiBi), or None.
        `recompute`: the long path keeps no group's output for backward (see _grouped); False where recomputing
        would draw other dropout masks (attention dropout under tensor parallelism's RNG tracker)."""
        lq, lk = q.shape[-2], k.shape[-2]
        if lq * lk <= DENSE_SIDE * DENSE_SIDE:
            allowed = self._dense(slice(None), start, lk, reversed_queries, 0)
            return sdpa(q, k, v, _mask_arguments(allowed, bias and bias(lq, lk, reversed_queries, q.dtype, q.device)))
        if recompute and torch.is_grad_enabled():
            return checkpoint(self._grouped, q, k, v, start, reversed_queries, sdpa, bias, use_reentrant=False)
        return self._grouped(q, k, v, start, reversed_queries, sdpa, bias)

    def _grouped(self, q, k, v, start, reversed_queries, sdpa, bias):
        """The long path: each row's groups of documents (_planned), each group's rows of one output. SDPA would
        keep each group's output for its backward beside that output (which the output projection keeps), one
        more (tokens x hidden) per layer: run under a checkpoint, the groups are attended again in backward
        instead, and a layer keeps what causal attention's does."""
        lq, lk = q.shape[-2], k.shape[-2]

        def biased(n, m):
            return None if bias is None else bias(n, m, reversed_queries, q.dtype, q.device)

        b, heads, _, d = q.shape
        out = q.new_empty(b, lq, heads, d)  # the caller's transpose and reshape of it are views
        for row in range(b):
            for first, end, key_start, whole in self._planned(row, start, lk):
                keys = slice(key_start, end)
                rows = slice(lk - end, lk - first) if reversed_queries else slice(first - start, end - start)
                n, m = end - first, end - key_start
                if whole:  # one document: causal with the queries last, no mask
                    mask = causal_arguments(n, m, reversed_queries, q.dtype, q.device) if bias is None else \
                        dict(attn_mask=biased(n, m))
                else:
                    allowed = self._dense(slice(row, row + 1), first, end, reversed_queries, key_start)
                    mask = _mask_arguments(allowed, biased(n, m))
                y = sdpa(q[row:row + 1, :, rows], k[row:row + 1, :, keys], v[row:row + 1, :, keys], mask)
                out[row:row + 1, rows] = y.transpose(1, 2)
        return out.transpose(1, 2)

    def _dense(self, rows, start, stop, reversed_queries, key_start):
        """(b, 1, stop - start, stop - key_start) booleans: query position i (of [start, stop), last first when
        reversed) may see key position j (of [key_start, stop)): j <= i in the same document."""
        name = (rows.start, start, stop, reversed_queries, key_start)
        if name not in self._masks:
            ids = self.ids[rows]
            queries = torch.arange(start, stop, device=ids.device)
            queries = queries.flip(0) if reversed_queries else queries
            keys = torch.arange(key_start, stop, device=ids.device)
            same = ids[:, queries].unsqueeze(-1) == ids[:, keys].unsqueeze(-2)
            self._masks[name] = (same & (keys <= queries.unsqueeze(-1))).unsqueeze(1)
        return self._masks[name]

    def _planned(self, row, start, stop):
        """Row `row`'s attention groups for the queries [start, stop): (first query, end, first key, one whole
        document) each, over consecutive documents whose keys span at most DENSE_SIDE positions, or one."""
        name = (row, start, stop)
        if name not in self._groups:
            starts = self.starts[row]
            i = bisect.bisect_right(starts, start) - 1
            groups = []
            while i < len(starts) and starts[i] < stop:
                doc_start = starts[i]
                end = min(starts[i + 1] if i + 1 < len(starts) else stop, stop)
                first = max(doc_start, start)
                if groups and end - groups[-1][2] <= DENSE_SIDE:
                    groups[-1] = (groups[-1][0], end, groups[-1][2], False)
                else:
                    groups.append((first, end, doc_start, True))
                i += 1
            self._groups[name] = groups
        return self._groups[name]


def _set_flags(documents):
    Documents.masking = documents is not None and documents.ids is not None
    Documents.positioning = documents is not None and documents.positions is not None


def _mask_arguments(allowed, bias):
    """SDPA's mask arguments: the boolean mask, or the additive bias with -inf where it forbids."""
    if bias is None:
        return dict(attn_mask=allowed)
    return dict(attn_mask=bias.masked_fill(~allowed, float("-inf")))


def causal_arguments(lq, lk, reversed_queries, dtype, device):
    """SDPA's mask arguments for causal attention of the last lq of lk positions, with no (lq x lk) tensor."""
    if reversed_queries:  # a Seq1F1B segment's order off CUDA (kv_cache.py): a strided view of one row
        return dict(attn_mask=reversed_causal_mask(lq, lk, dtype, device))
    if lq == lk:
        return dict(is_causal=True)
    # lazy: torch.nn.attention.bias imports dynamo (seconds), which an eager run never needs otherwise
    from torch.nn.attention.bias import causal_lower_right
    return dict(attn_mask=causal_lower_right(lq, lk))


def opened(documents):
    """`documents.opened()`, or nothing to open (None)."""
    return documents.opened() if documents is not None else contextlib.nullcontext()


# A compiled layer leaves these out of its graph: they read the open micro-batch's tensors, which differ each op.
@outside_graph
def documents_rope_tables(head_dim, theta, start, length, device, dtype, scaling=None):
    """cos and sin (b, 1, length, head_dim) of the open documents' positions [start, start + length), under RoPE
    scaling `scaling` (positions.rope_tables): made once per op and shared by its layers, as rope_tables are."""
    documents = Documents.current()
    if documents is None or documents.positions is None:
        return rope_tables(head_dim, theta, start, length, device, dtype, scaling)
    return documents.tables((head_dim, theta, start, length, device, dtype, scaling),
                            lambda: rope_tables_at(head_dim, theta, documents.rope_positions(start, length), dtype,
                                                   scaling))


@outside_graph
def documents_attention(q, k, v, start, reversed_queries, sdpa, bias=None, recompute=True):
    """Documents.attend of the open micro-batch's documents."""
    return Documents.current().attend(q, k, v, start, reversed_queries, sdpa, bias, recompute)


@outside_graph
def context_parallel_rope_tables(head_dim, theta, layout, length, start, device, dtype, scaling=None):
    """cos and sin (b or 1, 1, n, head_dim) of the global positions a context-parallel rank holds of the sequence
    (or Seq1F1B segment) of `length` tokens from `start` (layout.positions, a ContextLayout's), under RoPE scaling
    `scaling`: the open documents' restarted positions there when RoPE rotates by them, else the positions. Made
    once per op and shared by its layers, as rope_tables are without CP (each layer's rotation keeps them: one
    pair, not one a layer): memoed by the open documents, whose positions are their micro-batch's, else cached."""
    documents = Documents.current()
    if documents is not None and documents.positions is not None:
        return documents.rope_tables_at(head_dim, theta, layout, length, start, device, dtype, scaling)
    return _context_parallel_rope_tables(head_dim, theta, layout, length, start, device, dtype, scaling)


@functools.lru_cache(maxsize=64)
def _context_parallel_rope_tables(head_dim, theta, layout, length, start, device, dtype, scaling):
    positions = layout.positions(length, start, device=device)
    return rope_tables_at(head_dim, theta, positions.unsqueeze(0), dtype, scaling)
