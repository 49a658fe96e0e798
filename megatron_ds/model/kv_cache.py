"""The sequence-segment K/V cache (Seq1F1B): the model's second runtime hook.

When a micro-batch's sequence is cut into segments that run forward one at a time
(0, 1, ..., k-1), segment j's queries must still see the keys and values of every
earlier position. The runtime opens a segment around each op it runs
(`with cache.segment(key, start, stop, total):`, like `WeightGradStore.deferring`), and
every attention layer then calls `segment.extend(slot, k, v)` (its `KVSlot`), which

- writes the segment's keys/values into the micro-batch's per-layer buffers at
  [start, stop), so a recomputed segment (activation checkpointing) rewrites its own
  positions and never appends; and
- returns the keys/values of positions [0, stop), to be attended with a
  bottom-right-aligned causal mask (`segment.causal_mask`).

Buffers. Each (micro-batch, layer) has one buffer of keys and values, written in place.
Eager, it holds the positions the micro-batch's segments need and no more: laid out
positions first (a prefix of positions is a prefix of its storage), it grows to `stop` as
each segment opens forward and shrinks to `stop` as each opens backward (storage resized
in place: the views earlier segments saved stay valid), so a rank holds K/V of the tokens
in flight only, as it holds their other activations. A compiled layer's graph is made for
one buffer shape, and CUDA graphs replay over the same memory: there the buffer holds all
`total` positions from the micro-batch's first segment on (`growing` False).
The open does the bookkeeping (order checks, fresh tensors over the buffers, each with
its own version counter, so writing later positions never trips autograd's in-place
check on the views earlier segments saved for backward); inside a layer the cache is
tensor operations and one autograd.Function, so a compiled layer is one graph, the
cache included. The open puts each layer's tensors in the layer's `KVSlot` (an
attribute of the layer, not a key the graph would be specialised on: every layer
shares one graph per segment shape). The cache learns a chunk's layers from its first
segment, which runs eagerly, and lays out every later micro-batch's buffers when it
opens.

Query order. On CUDA the flash kernels align the causal mask bottom-right themselves
(nothing materialised). Elsewhere (CPU) SDPA needs a mask tensor, and an (lq, lk) one
per segment shape is as large as a segment's activations. So there the segment's
queries go last position first (`segment.queries`, reversed back by `segment.outputs`
after the output projection, which acts per token): query i may see key j iff
i + j <= lk - 1, and the mask is a strided view of one row of lq + lk - 1 values
(mask[i, j] = row[i + j]).

Backward runs last segment first. The gradient reaching a segment's keys/values
covers [0, stop): its own positions take it plus what later segments owe them, and
the part of earlier positions is added into the micro-batch's owed-gradient buffer
(allocated, zeroed, when its first backward opens). Each segment's autograd graph thus
stays separate (the runtime runs one graph per op), and all of this happens in the
op's backward for inputs (B), never in W. The buffers are released when the runtime
frees the micro-batch: after segment 0's backward, or its last forward in evaluation.

Context parallelism. A segment is laid out over the CP ranks on its own (context_parallel/layout.py) and its
queries see every earlier position on every rank. Under allgather and a2a a rank caches the gathered segment
(every position; a2a: its head group's), written at [start, stop) as without CP. Under p2p a rank caches only its
own chunks of each segment (`extend(..., share=C)`: its buffers hold 1 / C of the positions, segment after
segment), and the ring passes the whole cached prefix around; the segment's `spans` tell which global positions
each rank's cached keys are. Either way the gradients owed to earlier positions wait here as without CP.

Outside an open segment attention is plain full causal attention.
"""
import contextlib

import torch

from .compile import CompileMode, outside_graph


def queries_reversed(device) -> bool:
    """Whether a segment's queries go last position first on `device` (see the module's docstring)."""
    return torch.device(device).type != "cuda"


def segment_queries(q):
    """A copy of q (b, heads, s, head_dim), last position first where queries_reversed, in the
    projection's (b, s, heads, head_dim) memory order (so the attention output reshapes without
    a copy). k and v live in the cache now: the copy alone keeps q from holding on to the fused
    qkv projection output. Pure: a compiled layer runs it, and its backward, in its graph."""
    q = q.transpose(1, 2)
    return (q.flip(1) if queries_reversed(q.device) else q.contiguous()).transpose(1, 2)


def segment_outputs(y):
    """A segment's attention output (b, s, hidden) from its queries' order back to position order
    (pure: a compiled layer runs it in its graph)."""
    return y.flip(1) if queries_reversed(y.device) else y


def _positions(t, start, stop):
    """t[:, :, start:stop] of a (b, heads, positions, head_dim) tensor."""
    return t[:, :, start:stop]


def _half(buffer, which, start, stop):
    """Positions [start, stop) of the keys (which=0) or values (1) of a (2, b, heads, positions, head_dim)
    buffer (either layout: _Entry), as one view operator."""
    _, b, h, _, d = buffer.shape
    strides = buffer.stride()
    return torch.as_strided(buffer, (b, h, stop - start, d), strides[1:], which * strides[0] + start * strides[3])


class KVSlot:
    """A layer's place in the cache: while a segment is open, `buffers` holds the layer's fresh
    (keys and values, owed gradients) tensors over the micro-batch's buffers; None otherwise."""
    buffers = None


class _Entry:
    """One (micro-batch, layer): its keys-and-values buffer (2, b, heads, positions, head_dim), and the
    gradients owed to their positions. `static`: the tensors over them are a CUDA graph's static inputs
    (SegmentKVCache's docstring). `growing`: the buffers hold the positions `reach` asks for, laid out
    positions first; else all `total`, contiguous (the module's docstring). `share`: the context-parallel ranks a
    position is split over (p2p caches a rank's own chunks of each segment: 1 / share of every position range)."""

    def __init__(self, b, heads, head_dim, total, dtype, device, share=1, static=False, growing=False):
        total //= share
        self.shape, self.dtype, self.device, self.static = (2, b, heads, total, head_dim), dtype, device, static
        self.growing, self.share = growing, share
        self.position_nbytes = 2 * b * heads * head_dim * dtype.itemsize
        self.nbytes = total * self.position_nbytes
        self.kv = torch.UntypedStorage(0 if growing else self.nbytes, device=device)
        self.owed = torch.UntypedStorage(0, device=device)  # memory at the first backward
        self.owing = False  # the owed gradients are zeroed for the micro-batch now using the entry
        self.busy = True  # a micro-batch uses it (a static cache reuses a free one)

    def _tensor(self, storage):
        """A tensor over `storage` (the keys and values, or the owed gradients: the same shape, so that a
        recomputed segment saves what its forward saved)."""
        empty = storage.nbytes() == 0
        if self.growing:
            _, b, h, _, d = self.shape
            positions = self.kv.nbytes() // self.position_nbytes
            t = torch.empty(0, dtype=self.dtype, device=self.device).set_(
                storage, 0, (2, b, h, positions, d), (b * h * d, h * d, d, 2 * b * h * d, 1))
        else:
            t = torch.empty(0, dtype=self.dtype, device=self.device).set_(storage, 0, self.shape)
        if empty:  # set_ grew it: the owed buffer stays empty before the first backward (only saved until then)
            storage.resize_(0)
        if self.static:  # no guard on the tensor object: a fresh one each open, over the same memory
            torch._dynamo.mark_static_address(t, guard=False)
        return t

    def tensors(self):
        """Fresh tensors (keys and values, owed gradients) over the buffers, (2, b, heads, total, head_dim)."""
        return self._tensor(self.kv), self._tensor(self.owed)

    def reach(self, stop):
        """A growing entry: hold positions [0, stop) (of the owed gradients too, once owing), no more."""
        if self.growing:
            for storage in (self.kv, self.owed) if self.owing else (self.kv,):
                storage.resize_(stop // self.share * self.position_nbytes)

    def owe(self):
        """Give the owed gradients their memory, zeros, when the micro-batch's first backward opens."""
        if not self.owing:
            if self.owed.nbytes() == 0:
                self.owed.resize_(self.kv.nbytes() if self.growing else self.nbytes)
            self._tensor(self.owed).zero_()
            self.owing = True


class _Extend(torch.autograd.Function):
    """(a segment's k, v, the keys-and-values buffer, its owed gradients, start) -> keys, values of the
    buffer's positions [0, stop)."""

    @staticmethod
    def forward(ctx, k, v, buffer, owed, start):
        stop = start + k.shape[2]
        ctx.start, ctx.stop = start, stop
        ctx.save_for_backward(owed)
        _half(buffer, 0, start, stop).copy_(k)
        _half(buffer, 1, start, stop).copy_(v)
        return _half(buffer, 0, 0, stop), _half(buffer, 1, 0, stop)

    @staticmethod
    def backward(ctx, grad_keys, grad_values):
        owed, = ctx.saved_tensors
        if not torch.compiler.is_compiling() and owed.untyped_storage().nbytes() == 0:
            raise RuntimeError("a segment ran backward outside its cache.segment(...): each segment's backward "
                               "runs inside its segment, last segment first")
        start, stop = ctx.start, ctx.stop
        own = [_positions(grad, start, stop) + _half(owed, i, start, stop)
               for i, grad in enumerate((grad_keys, grad_values))]
        if start:  # the earlier positions' share, for the earlier segments' backward
            for i, grad in enumerate((grad_keys, grad_values)):
                _half(owed, i, 0, start).add_(_positions(grad, 0, start))
        return own[0], own[1], None, None, None


class Segment:
    """What the runtime runs now: the segment from position `offset` of a `total`-token micro-batch."""

    def __init__(self, cache, key, offset, total, backward, bias, spans=()):
        self.cache, self.key, self.offset, self.total = cache, key, offset, total
        self.spans = spans  # (start, stop) of the micro-batch's segments cached so far, this one last
        self.backward = backward  # the op is the segment's backward (recomputation included)
        self.bias = bias  # on CUDA, the segment's bottom-right causal bias, made before the layers run
        self.filled = []  # the KVSlots given this op's buffers: emptied when it closes

    def fill(self, slot, entry):
        slot.buffers = entry.tensors()
        self.filled.append(slot)

    def extend(self, slot, k, v, share=1):
        """The keys/values of the layer whose KVSlot is `slot`: the micro-batch's earlier segments'
        followed by k, v (b, heads, s, d). `share` > 1: k, v are a context-parallel rank's 1 / share of the
        segment's positions, cached after its 1 / share of every earlier segment's (p2p's local K/V)."""
        buffers = slot.buffers
        b, h, s, d = k.shape
        offset = self.offset // share
        if (buffers is None or buffers[0].dtype != k.dtype or buffers[0].shape[:3] != (2, b, h)
                or buffers[0].shape[4] != d or buffers[0].shape[3] < offset + s):
            buffers = _lay_out(self, slot, k, share)
        return _Extend.apply(k, v, *buffers, offset)

    def queries(self, q):
        """The segment's queries in the order its causal mask expects (segment_queries)."""
        return segment_queries(q)

    def outputs(self, y):
        """The attention block's output (b, s, hidden) back in position order."""
        return segment_outputs(y)

    def causal_mask(self, q, k):
        """Query i of the segment (position offset + i) sees keys [0, offset + i]: the causal mask
        aligned bottom-right, for queries as `queries` ordered them. None: is_causal does it."""
        lq, lk = q.shape[-2], k.shape[-2]
        if queries_reversed(q.device):
            return self.cache._reversed_mask(lq, lk, q.dtype, q.device)
        if lq == lk:
            return None
        return self.bias if self.bias is not None else _lower_right(lq, lk)


@outside_graph  # a layer the open found no buffers for: the chunk's first segment (eager), or another shape
def _lay_out(segment, slot, k, share=1):
    b, h, _, d = k.shape
    entry = segment.cache._new_entry(segment.key, slot, (b, h, d, segment.total, k.dtype, k.device, share))
    entry.reach(segment.offset + k.shape[2] * share)
    if segment.backward:
        entry.owe()
    segment.fill(slot, entry)
    return slot.buffers


def _lower_right_bias(lq, lk):
    # lazy: torch.nn.attention.bias imports dynamo (seconds), which an eager run never needs otherwise
    from torch.nn.attention.bias import causal_lower_right
    return causal_lower_right(lq, lk)  # flash / memory-efficient kernels, nothing materialised


# where the open made no bias (nothing laid out for the chunk yet): its constructor would break a graph
_lower_right = outside_graph(_lower_right_bias)


class SegmentKVCache:
    """Keys and values of the segments that have run forward, per (micro-batch key, layer's KVSlot).

    `key` is the runtime's name for one micro-batch on one model chunk, a pair (chunk, micro-batch):
    the cache lays out a micro-batch's buffers for the layers its chunk's earlier micro-batches had.
    `free(key)` drops it after the micro-batch's last backward there (or after its last forward in eval).

    `static` (CUDA graphs, "pipeline.cuda_graphs"): a compiled layer writes the keys/values into its inputs,
    which inductor's CUDA graphs accept only of static inputs, whose memory is the same at each replay. So
    a static cache keeps the buffers of freed micro-batches and gives the next micro-batch the first free
    ones: the same schedule takes the same buffers in the same order every iteration. It keeps, between
    iterations too, the keys/values and owed gradients of as many micro-batches as were ever in flight at
    once: the owed gradients of a micro-batch still in forward are held, where an ordinary cache has none.

    `growing` (None: where the layers are not compiled): each buffer holds only the positions its
    micro-batch's segments need (the module's docstring); never under `static`.
    """
    _open = None  # the Segment of the op the runtime is running, None outside one
    opened = False  # _open is not None: what a compiled layer reads (its graphs depend on it, not on the Segment)

    def __init__(self, static=False, growing=None):
        self.static, self.growing = static, growing
        self._pool = {}  # layout -> [_Entry] a static cache made, in the order it made them (kept and reused)
        self._entries = {}  # key -> {KVSlot -> _Entry}
        self._runs = {}  # key -> [(start, stop)] of its segments run forward and not yet backward
        self._layouts = {}  # chunk -> {KVSlot -> (b, heads, head_dim, total, dtype, device)}
        self._masks = {}  # (lq, lk, dtype, device) -> mask (a view of one row), shared by all layers and micro-batches

    @classmethod
    def current(cls):
        return cls._open

    @contextlib.contextmanager
    def segment(self, key, start, stop, total):
        """Open segment [start, stop) of micro-batch `key` (a pair: chunk, micro-batch) for the op the
        runtime runs now: its next forward, or the backward (and recomputation) of its last segment
        not yet run backward."""
        entries, backward = self._enter(key, start, stop, total)
        bias = None
        if start and entries and not queries_reversed(next(iter(entries.values())).device):
            bias = _lower_right_bias(stop - start, stop)
        spans = tuple(self._runs[key]) + (((start, stop),) if backward else ())
        segment = Segment(self, key, start, total, backward, bias, spans)
        for slot, entry in entries.items():
            segment.fill(slot, entry)
        previous, SegmentKVCache._open = SegmentKVCache._open, segment
        SegmentKVCache.opened = True
        # the chunk's first segment learns its layers eagerly: a graph compiled around the lay-out would
        # stay in dynamo's cache (its guards do not see the buffers) and break every later segment's layer
        first = CompileMode.layers_compiled and not entries
        try:
            with torch.compiler.set_stance("force_eager") if first else contextlib.nullcontext():
                yield segment
        finally:
            for slot in segment.filled:  # no tensors left behind: a freed micro-batch's buffers go with it
                slot.buffers = None
            SegmentKVCache._open = previous
            SegmentKVCache.opened = previous is not None

    def _enter(self, key, start, stop, total):
        """Check the order of the segments of `key` and lay out or prepare its buffers: (its entries, whether
        the op is a backward)."""
        runs = self._runs.setdefault(key, [])
        done = runs[-1][1] if runs else 0
        entries = self._entries.setdefault(key, {})
        if start == done and stop <= total:  # the next forward
            runs.append((start, stop))
            if start == 0:
                chunk, _ = key
                for slot, layout in self._layouts.get(chunk, {}).items():
                    if layout[3] == total:
                        entries[slot] = self._take(layout)
            for entry in entries.values():
                entry.reach(stop)
            return entries, False
        if runs and (start, stop) == runs[-1]:  # its backward
            runs.pop()
            for entry in entries.values():
                entry.reach(stop)
                entry.owe()
            return entries, True
        if start > done or stop > total:
            raise RuntimeError(f"segment [{start}, {stop}) does not continue the cached positions [0, {done}) of a "
                               f"{total}-token sequence: segments must run forward in order")
        raise RuntimeError(f"the segment [{start}, {stop}) ran backward while {list(runs[-1:])} was due: "
                           "segments must run backward last segment first")

    def _new_entry(self, key, slot, layout):
        chunk, _ = key
        self._layouts.setdefault(chunk, {})[slot] = layout
        entry = self._entries[key][slot] = self._take(layout)
        return entry

    def _take(self, layout):
        """A static cache's first free entry of `layout` (the same schedule takes the same ones each
        iteration), else a new one."""
        if not self.static:
            growing = not CompileMode.layers_compiled if self.growing is None else self.growing
            return _Entry(*layout, growing=growing)
        entries = self._pool.setdefault(layout, [])
        entry = next((e for e in entries if not e.busy), None)
        if entry is None:
            entry = _Entry(*layout, static=True)
            entries.append(entry)
        entry.busy, entry.owing = True, False
        return entry

    def free(self, key):
        for entry in self._entries.pop(key, {}).values():
            entry.busy = False  # a static cache keeps its memory for the next micro-batch
        self._runs.pop(key, None)

    def keys(self):
        """The micro-batch keys that still hold cached keys/values."""
        return list(self._entries)

    def kv_tensors(self):
        """The keys-and-values buffers the cache holds (e.g. to account for memory), (2, b, heads, positions, d)."""
        for layers in self._entries.values():
            for entry in layers.values():
                yield entry._tensor(entry.kv)

    def mask_tensors(self):
        """The causal masks' storage (CPU): one row per segment shape, shared by all layers."""
        return list(self._masks.values())

    def _reversed_mask(self, lq, lk, dtype, device):
        """The additive bottom-right causal mask for queries last first: (lq, lk), row[i + j]. A compiled
        layer makes it in its graph (a few elementwise ops) rather than reading Python state."""
        name, compiling = (lq, lk, dtype, device), torch.compiler.is_compiling()
        mask = None if compiling else self._masks.get(name)
        if mask is None:
            mask = reversed_causal_mask(lq, lk, dtype, device)
            if not compiling:
                self._masks[name] = mask
        return mask


def reversed_causal_mask(lq, lk, dtype, device):
    """The additive causal mask (lq, lk) of the last lq of lk positions as queries, last first: query i sees key
    j iff i + j <= lk - 1, so mask[i, j] = row[i + j], a strided view of one row of lq + lk - 1 values."""
    row = torch.zeros(lq + lk - 1, dtype=dtype, device=device)
    row = row.index_fill_(0, torch.arange(lk, lq + lk - 1, device=device), float("-inf"))
    return torch.as_strided(row, (lq, lk), (1, 1))
