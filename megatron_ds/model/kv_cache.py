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

Backward runs last segment first. The gradient reaching the returned keys/values
covers [0, offset + len): the part of earlier positions is kept here for the
earlier segments, which add it to their own when their backward runs. Each
segment's autograd graph thus stays separate (the runtime runs one graph per op),
and all of this happens in the op's backward for inputs (B), never in W.

Outside an open segment attention is plain full causal attention.
"""
from contextlib import contextmanager

import torch
from torch.nn.attention.bias import causal_lower_right


class _Entry:
    """One (micro-batch, layer): keys/values written so far, gradients owed to earlier positions."""

    def __init__(self):
        self.keys = self.values = None  # (b, heads, total, head_dim)
        self.filled = 0  # positions [0, filled) hold keys/values
        self.grad_keys = self.grad_values = None  # gradients of positions [0, grad_end)
        self.grad_end = None  # None until the first backward: it must be the last segment's

    def write(self, offset, k, v, total):
        if self.keys is None:
            b, h, _, d = k.shape
            self.keys = k.new_empty(b, h, total, d)
            self.values = v.new_empty(b, h, total, d)
        end = offset + k.shape[2]
        if offset > self.filled or end > self.keys.shape[2]:
            raise RuntimeError(f"segment [{offset}, {end}) does not continue the cached positions "
                               f"[0, {self.filled}) of a {self.keys.shape[2]}-token sequence: "
                               "segments must run forward in order")
        # Written through .data: the views handed to earlier segments (saved by their attention
        # for backward) cover only positions before `offset`, and autograd's in-place check on
        # them must not fire for positions they do not see.
        self.keys.data[:, :, offset:end].copy_(k)
        self.values.data[:, :, offset:end].copy_(v)
        self.filled = max(self.filled, end)
        return self.keys[:, :, :end], self.values[:, :, :end]

    def hand_back(self, offset, grad_k, grad_v):
        end = grad_k.shape[2]
        expected = self.filled if self.grad_end is None else self.grad_end
        if end != expected:
            raise RuntimeError(f"the segment ending at position {end} ran backward while the one ending at "
                               f"{expected} was due: segments must run backward last segment first")
        if self.grad_keys is not None:
            grad_k, grad_v = grad_k + self.grad_keys, grad_v + self.grad_values
        self.grad_end = offset
        self.grad_keys, self.grad_values = (grad_k[:, :, :offset], grad_v[:, :, :offset]) if offset else (None, None)
        return grad_k[:, :, offset:], grad_v[:, :, offset:]


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

    def causal_mask(self, q, k):
        """None when q and k span the same positions (use is_causal); else query i of the segment
        sees keys [0, offset + i]: the causal mask aligned bottom-right."""
        lq, lk = q.shape[-2], k.shape[-2]
        if lq == lk:
            return None
        if q.device.type == "cuda":
            return causal_lower_right(lq, lk)  # flash / memory-efficient kernels, nothing materialised
        return self.cache._additive_mask(lq, lk, q.dtype, q.device)


class SegmentKVCache:
    """Keys and values of the segments that have run forward, per (micro-batch key, layer id).

    `key` is the runtime's name for one micro-batch on one model chunk; `free(key)` drops
    it after the micro-batch's last backward there (or after its last forward in eval).
    """
    _open = None  # the Segment of the op the runtime is running, None outside one

    def __init__(self):
        self._entries = {}  # key -> {layer id -> _Entry}
        self._masks = {}  # (lq, lk, dtype, device) -> additive mask, shared by every layer and micro-batch

    @classmethod
    def current(cls):
        return cls._open

    @contextmanager
    def segment(self, key, offset, total):
        previous, SegmentKVCache._open = SegmentKVCache._open, Segment(self, key, offset, total)
        try:
            yield SegmentKVCache._open
        finally:
            SegmentKVCache._open = previous

    def free(self, key):
        self._entries.pop(key, None)

    def keys(self):
        """The micro-batch keys that still hold cached keys/values."""
        return list(self._entries)

    def kv_tensors(self):
        """The keys/values buffers the cache holds (e.g. to account for memory)."""
        for layers in self._entries.values():
            for entry in layers.values():
                if entry.keys is not None:
                    yield from (entry.keys, entry.values)

    def mask_tensors(self):
        """The materialised causal masks (CPU), one per segment shape, shared by all layers."""
        return list(self._masks.values())

    def _additive_mask(self, lq, lk, dtype, device):
        name = (lq, lk, dtype, device)
        if name not in self._masks:
            allowed = torch.ones(lq, lk, dtype=torch.bool, device=device).tril(lk - lq)
            self._masks[name] = torch.zeros(lq, lk, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))
        return self._masks[name]
