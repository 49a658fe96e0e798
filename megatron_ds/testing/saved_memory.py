"""The bytes autograd keeps for backward, live and at their peak: what activation memory a pass holds.

Three kinds of tensors are kept: those autograd's nodes save (seen through torch's saved_tensors_hooks), the
inputs of DeepSpeed's checkpoint (a recomputed layer or attention core), which its function holds as
attributes where no hook sees them, and what a split backward's B queues for its W (model/linear.py: each
deferred weight GEMM's input and output gradient, held by the queued call until W drains it). Each storage counts once however many tensors view it, parameters not at
all; a tensor counts from when it is first kept until its last keeper lets go. A recomputation in backward
saves through the hooks too, so the peak includes what a recomputed layer holds while its backward runs.

    meter = SavedMemory(exclude=model.parameters())
    with meter.recording():
        loss = model(x).sum()
        loss.backward()
    meter.peak

A Seq1F1B run's K/V cache (`cache`, model/kv_cache.SegmentKVCache) is counted from the cache itself: its buffers
at their full length whenever anything is saved (the views saved of them add nothing), its masks as "mask";
`at_peak` splits the peak into those kinds. `transient` (a callable: bytes) adds what a pass holds outside autograd
while it runs (a ring's K/V blocks and gradient blocks in flight, bench/cp_memory.py): `peak_all` is the peak of
the kept bytes and those together, sampled at every save and at every `sample()` (call it where the transient
buffers grow), `at_peak_all` its split (kind "transient" added); `peak` stays the kept bytes' own. `RingBuffers`
is such a source: the ring attention's K/V and gradient blocks, counted from their allocation until nothing
holds them. `PeakRSS` is the process's side: its resident memory's high-water
mark over a stretch of code (Linux), which also sees what no autograd node keeps (transient buffers).
"""
import contextlib
import re
import weakref

import torch
from deepspeed.runtime.activation_checkpointing.checkpointing import CheckpointFunction

from megatron_ds.model.linear import WeightGradStore


class SavedMemory:

    def __init__(self, exclude=(), cache=None, transient=None):
        self.exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self.cache, self.transient = cache, transient
        self.live = {}  # storage pointer -> [keepers, bytes, kind]
        self.now = self.peak = 0
        self.by_kind = {"kv": 0, "mask": 0, "other": 0}
        self.at_peak = dict(self.by_kind)
        self.peak_all, self.at_peak_all = 0, dict(self.by_kind, transient=0)

    def _kind(self, ptr):
        if self.cache is not None:
            if ptr in {t.untyped_storage().data_ptr() for t in self.cache.kv_tensors()}:
                return "kv"
            if ptr in {t.untyped_storage().data_ptr() for t in self.cache.mask_tensors()}:
                return "mask"
        return "other"

    def _kv_bytes(self):
        return sum(t.untyped_storage().nbytes() for t in self.cache.kv_tensors()) if self.cache is not None else 0

    def _update_peak(self):
        kv = self._kv_bytes()
        if self.now + kv > self.peak:
            self.peak, self.at_peak = self.now + kv, dict(self.by_kind, kv=kv)
        self._sample_all(kv)

    def _sample_all(self, kv):
        extra = self.transient() if self.transient is not None else 0
        if self.now + kv + extra > self.peak_all:
            self.peak_all, self.at_peak_all = self.now + kv + extra, dict(self.by_kind, kv=kv, transient=extra)

    def sample(self):
        """Note the kept bytes with the transient ones as they are now (for `peak_all`)."""
        self._sample_all(self._kv_bytes())

    def pack(self, tensor):
        ptr = tensor.untyped_storage().data_ptr()
        if ptr in self.exclude or tensor.device.type == "meta":
            return tensor
        kind = self._kind(ptr)
        if kind == "kv":  # counted from the cache itself (its buffers, not the views saved of them)
            self._update_peak()
            return tensor
        if ptr not in self.live:
            self.live[ptr] = [0, tensor.untyped_storage().nbytes(), kind]
            self.now += self.live[ptr][1]
            self.by_kind[kind] += self.live[ptr][1]
            self._update_peak()
        self.live[ptr][0] += 1
        return _Kept(self, ptr, tensor)

    @staticmethod
    def unpack(kept):
        return kept.tensor if isinstance(kept, _Kept) else kept

    def release(self, ptr):
        entry = self.live[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            del self.live[ptr]
            self.now -= entry[1]
            self.by_kind[entry[2]] -= entry[1]

    def reset_peak(self):
        self.peak = self.now
        self.at_peak = dict(self.by_kind)
        self.peak_all, self.at_peak_all = 0, dict(self.by_kind, transient=0)
        self.sample()

    @contextlib.contextmanager
    def recording(self):
        """Count what autograd keeps while inside (the checkpoint's inputs included)."""
        original = CheckpointFunction.forward

        def forward(ctx, run_function, all_outputs, *args):
            out = original(ctx, run_function, all_outputs, *args)
            # the node (ctx) holds its inputs until autograd frees it after its backward
            ctx.kept_by_meter = [self.pack(a) for a in args if torch.is_tensor(a)]
            return out
        CheckpointFunction.forward = staticmethod(forward)
        descriptors = {name: WeightGradStore.__dict__[name] for name in ("deferring", "drain")}
        deferring, drain, queued = WeightGradStore.deferring, WeightGradStore.drain, {}  # id(queue) -> [_Kept]

        @contextlib.contextmanager
        def metered_deferring(queue):
            with deferring(_MeteredQueue(queue, self, queued.setdefault(id(queue), []))):
                yield queue

        def metered_drain(queue):
            drain(queue)
            queued.pop(id(queue), None)
        WeightGradStore.deferring, WeightGradStore.drain = metered_deferring, metered_drain
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield self
        finally:
            CheckpointFunction.forward = staticmethod(original)
            for name, descriptor in descriptors.items():
                setattr(WeightGradStore, name, descriptor)


class _MeteredQueue:
    """A B op's queue of deferred weight GEMMs as the layers see it: what each queued call holds is kept until
    the W op drains the queue."""

    def __init__(self, queue, meter, kept):
        self.queue, self.meter, self.kept = queue, meter, kept

    def append(self, compute):
        cells = [c.cell_contents for c in (getattr(compute, "__closure__", None) or ())]
        self.kept.extend(self.meter.pack(t) for t in cells if torch.is_tensor(t))
        self.queue.append(compute)


class _Kept:
    """One keeper of a storage; its bytes are released when the last keeper is dropped."""

    def __init__(self, meter, ptr, tensor):
        self.meter, self.ptr, self.tensor = meter, ptr, tensor

    def __del__(self):
        self.meter.release(self.ptr)


class RingBuffers:
    """The ring attention's blocks alive in this process (model/context_parallel/ring.py): each stacked K/V block,
    each receive buffer and each gradient block, from its allocation until its last holder (the ring's variables,
    a communication work that sent or received it, a view) lets go; `now` and `peak` their bytes. Seen through
    the torch that ring.py calls (`installed`): every 5-dimensional tensor its torch.stack, zeros and empty_like
    make is a block ((K, V) x batch x heads x positions x head size; its other tensors have 3 or 4). `meter`
    (a SavedMemory): sampled at each allocation, so its peak_all is the kept and ring bytes' joint peak."""

    MAKERS = ("stack", "zeros", "empty_like")

    def __init__(self, meter=None):
        self.meter, self.live = meter, {}  # id(tensor) -> (bytes, weak reference)
        self.now = self.peak = 0

    def track(self, t):
        key = id(t)

        def gone(_):
            self.now -= self.live.pop(key)[0]
        self.live[key] = (t.untyped_storage().nbytes(), weakref.ref(t, gone))  # the reference lives while t does
        self.now += self.live[key][0]
        self.peak = max(self.peak, self.now)
        if self.meter is not None:
            self.meter.sample()

    @contextlib.contextmanager
    def installed(self, ring):
        """ring.py (the module) calls a torch that tracks its blocks while inside."""
        real = ring.torch
        buffers = self

        class Torch:
            def __getattr__(self, name):
                value = getattr(real, name)
                if name not in RingBuffers.MAKERS:
                    return value

                def made(*args, **kwargs):
                    t = value(*args, **kwargs)
                    if t.dim() == 5:
                        buffers.track(t)
                    return t
                return made
        ring.torch = Torch()
        try:
            yield self
        finally:
            ring.torch = real


def _status_kb(field):
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1)) * 1024


class PeakRSS:
    """`with PeakRSS() as rss:` ... `rss.growth`: the bytes the process's resident set rose to above where it stood
    on entry (VmHWM reset to VmRSS through /proc/self/clear_refs), `rss.peak` its high-water mark. Large tensors
    follow the RSS only when the allocator returns them to the system: set MALLOC_MMAP_THRESHOLD_ (64 KiB) in
    the environment of a fresh process."""

    def __enter__(self):
        self.before = _status_kb("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        return self

    def __exit__(self, *exc):
        self.peak = _status_kb("VmHWM")
        self.growth = self.peak - self.before
        return False
