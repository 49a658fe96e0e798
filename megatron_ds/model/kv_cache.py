"""The sequence-segment K/V cache (Seq1F1B): the model's second runtime hook.

When a micro-batch's sequence is cut into segments that run forward one at a time
(0, 1, ..., k-1), segment j's queries must still see the keys and values of every
earlier position. The runtime opens a segment around each op it runs
(`with cache.segment(key, offset, total):`, like `WeightGradStore.deferring`), and
every attention layer then calls `segment.extend(layer_id, k, v)`, which

- writes the segment's keys/values into the micro-batch's per-layer buffer at
  [offset, offset + len), so a recomputed segment (activation checkpointing)
  rewrites its own slice and never appends; and
- returns the keys/values of positions [0, offset + len), to be attended with a
  bottom-right-aligned causal mask (`segment.causal_mask`).

The buffer holds only the positions some segment still needs: it grows in place as
segments run forward and shrinks as they run backward (its storage is resized, positions
outermost, so the views earlier segments saved for backward keep their strides and see
the moved data). Segments not yet run forward, or already run backward, hold no K/V
memory, as under 1F1B.

Query order. On CUDA the flash kernels align the causal mask bottom-right themselves
(nothing materialised). Elsewhere (CPU) SDPA needs a mask tensor, and an (lq, lk) one
per segment shape is as large as a segment's activations. So there the segment's
queries go last position first (`segment.queries`, reversed back by `segment.outputs`
after the output projection, which acts per token): query i may see key j iff
i + j <= lk - 1, and the mask is a strided view of one row of lq + lk - 1 values
(mask[i, j] = row[i + j]).

Backward runs last segment first. The gradient reaching the returned keys/values
covers [0, offset + len): the part of earlier positions is kept here for the
earlier segments, whose backward adds its own into it in place (no new buffer per segment). Each
segment's autograd graph thus stays separate (the runtime runs one graph per op),
and all of this happens in the op's backward for inputs (B), never in W.

Outside an open segment attention is plain full causal attention.
"""
from contextlib import contextmanager

import torch
from torch.nn.attention.bias import causal_lower_right


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


class _Entry:
    """One (micro-batch, layer): keys/values written so far, gradients owed to earlier positions."""

    def __init__(self):
        self.storages = None  # keys', values' memory as (positions, b, heads, head_dim), grown per segment
        self.capacity = 0  # positions the storages hold
        self.filled = 0  # positions [0, filled) hold keys/values
        self.grad_keys = self.grad_values = None  # gradients of positions [0, grad_end)
        self.grad_end = None  # None until the first backward: it must be the last segment's

    def _tensors(self, positions):
        """Fresh tensors over the storages, (b, heads, positions, head_dim). Fresh ones, each with its own
        version counter: writing the new positions must not trip autograd's in-place check on the
        views earlier segments saved for backward (they do not see those positions)."""
        b, h, d = self.shape
        strides = (h * d, d, b * h * d, 1)  # positions outermost in memory
        return [torch.empty(0, dtype=self.dtype, device=s.device).set_(s, 0, (b, h, positions, d), strides)
                for s in self.storages]

    def write(self, offset, k, v, total):
        end = offset + k.shape[2]
        if offset > self.filled or end > total:
            raise RuntimeError(f"segment [{offset}, {end}) does not continue the cached positions "
                               f"[0, {self.filled}) of a {total}-token sequence: segments must run forward in order")
        if self.storages is None:
            b, h, _, d = k.shape
            self.shape, self.dtype = (b, h, d), k.dtype
            self.position_bytes = b * h * d * k.element_size()
            self.storages = [torch.UntypedStorage(0, device=k.device) for _ in (k, v)]
        if end > self.capacity:
            self._resize(end)
        keys, values = self._tensors(end)
        _positions(keys, offset, end).copy_(k)
        _positions(values, offset, end).copy_(v)
        self.filled = max(self.filled, end)
        return keys, values

    def hand_back(self, offset, grad_k, grad_v):
        end = grad_k.shape[2]
        expected = self.filled if self.grad_end is None else self.grad_end
        if end != expected:
            raise RuntimeError(f"the segment ending at position {end} ran backward while the one ending at "
                               f"{expected} was due: segments must run backward last segment first")
        if self.grad_keys is not None:
            # into what the later segments left: the positions [0, end) only earlier segments take
            grad_k, grad_v = self.grad_keys.add_(grad_k), self.grad_values.add_(grad_v)
        self.grad_end = offset
        self.grad_keys, self.grad_values = ((_positions(grad_k, 0, offset), _positions(grad_v, 0, offset))
                                            if offset else (None, None))
        self._resize(offset)  # no earlier segment sees this one's positions: release them now
        return _positions(grad_k, offset, end), _positions(grad_v, offset, end)

    def _resize(self, positions):
        """Grow or shrink the storages in place to `positions`; the views earlier segments saved keep
        their strides (positions are outermost) and see the moved data."""
        for s in self.storages:
            s.resize_(positions * self.position_bytes)
        self.capacity = positions
        self.filled = min(self.filled, positions)


def _positions(t, start, stop):
    """t[:, :, start:stop] of a (b, heads, positions, head_dim) tensor as one view operator."""
    b, h, _, d = t.shape
    return t.as_strided((b, h, stop - start, d), t.stride(), t.storage_offset() + start * t.stride(2))


class _Extend(torch.autograd.Function):
    """(k, v) of one segment -> (keys, values) of every position up to the segment's end."""

    @staticmethod
    def forward(ctx, k, v, entry, offset, total):
        ctx.entry, ctx.offset = entry, offset
        return entry.write(offset, k, v, total)

    @staticmethod
    def backward(ctx, grad_keys, grad_values):
        grad_k, grad_v = ctx.entry.hand_back(ctx.offset, grad_keys, grad_values)
        return grad_k, grad_v, None, None, None


class Segment:
    """What the runtime runs now: segment [offset, offset + len) of a `total`-token micro-batch."""

    def __init__(self, cache, key, offset, total):
        self.cache, self.key, self.offset, self.total = cache, key, offset, total

    def extend(self, layer_id, k, v):
        """This layer's keys/values of the micro-batch's earlier segments followed by k, v (b, heads, s, d)."""
        entry = self.cache._entries.setdefault(self.key, {}).setdefault(layer_id, _Entry())
        return _Extend.apply(k, v, entry, self.offset, self.total)

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
        return causal_lower_right(lq, lk)  # flash / memory-efficient kernels, nothing materialised


class SegmentKVCache:
    """Keys and values of the segments that have run forward, per (micro-batch key, layer id).

    `key` is the runtime's name for one micro-batch on one model chunk; `free(key)` drops
    it after the micro-batch's last backward there (or after its last forward in eval).
    """
    _open = None  # the Segment of the op the runtime is running, None outside one
    opened = False  # _open is not None: what a compiled layer reads (its graphs depend on it, not on the Segment)

    def __init__(self):
        self._entries = {}  # key -> {layer id -> _Entry}
        self._masks = {}  # (lq, lk, dtype, device) -> mask row (lq + lk - 1 values), shared by all layers and micro-batches

    @classmethod
    def current(cls):
        return cls._open

    @contextmanager
    def segment(self, key, offset, total):
        previous, SegmentKVCache._open = SegmentKVCache._open, Segment(self, key, offset, total)
        SegmentKVCache.opened = True
        try:
            yield SegmentKVCache._open
        finally:
            SegmentKVCache._open = previous
            SegmentKVCache.opened = previous is not None

    def free(self, key):
        self._entries.pop(key, None)

    def keys(self):
        """The micro-batch keys that still hold cached keys/values."""
        return list(self._entries)

    def kv_tensors(self):
        """The keys/values buffers the cache holds (e.g. to account for memory), (b, heads, positions, d)."""
        for layers in self._entries.values():
            for entry in layers.values():
                if entry.storages is not None:
                    yield from entry._tensors(entry.capacity)

    def mask_tensors(self):
        """The causal masks' storage (CPU): one row per segment shape, shared by all layers."""
        return list(self._masks.values())

    def _reversed_mask(self, lq, lk, dtype, device):
        """The additive bottom-right causal mask for queries last first: (lq, lk), row[i + j]."""
        name = (lq, lk, dtype, device)
        if name not in self._masks:
            row = torch.zeros(lq + lk - 1, dtype=dtype, device=device)
            self._masks[name] = row.index_fill_(0, torch.arange(lk, lq + lk - 1, device=device), float("-inf"))
        return self._masks[name].as_strided((lq, lk), (1, 1))
