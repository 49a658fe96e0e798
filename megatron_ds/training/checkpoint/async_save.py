"""--async-save: the saving iteration copies the states to host memory, a thread of this rank writes them.

The copy (`HostBuffers`) is taken inside DeepSpeed's save through engine.Collector: every tensor of every state
DeepSpeed would write (layer files, model states with our client state, ZeRO shards) copied to host memory,
into pinned memory on CUDA (copies issued without blocking, then one synchronize before training goes on),
into buffers allocated at the first background save and reused by the later ones. Then
`Job.run`, on a thread of its own, writes each file in torch.save's format through zip_writer.py (the GIL
held little, each storage read once) and disk_full.write_torch (fsynced, out
of room recorded, not raised), takes its manifest entry (size, the CRC-32 taken while writing) and fsyncs the
step folder. The writer holds no collective and names nothing: saves.py commits the step at an iteration boundary
once every rank's job is done. The host buffers are free for the next save when the job ends.

Fault injection (kill_points.py): MEGATRON_DS_KILL_DURING_SAVE=ITER:RANK[:MOMENT] kills rank RANK (SIGKILL)
before its background write of iteration ITER (copied), after its first file (writing, the default) or after
its last (written). For tests, MEGATRON_DS_TEST_SAVE_DELAY_S=SECONDS
holds every background write back that long before its first file (a slow disk: training goes on meanwhile).
"""
import itertools
import os
import threading
import time

from . import engine as checkpoint_engine, kill_points
from .manifest import entry

DELAY_ENV = "MEGATRON_DS_TEST_SAVE_DELAY_S"


def host_copy(obj, pin=False):
    """`obj` with every tensor copied to fresh host memory (pinned when `pin`), containers rebuilt, other values
    shared (plain values the run does not change in place: numbers, strings, the frozen arguments)."""
    return _rebuild(obj, lambda t: HostBuffers(pin)._into(None, t))


class HostBuffers:
    """The host copies' memory, allocated at the first background save and reused by the later ones (pinned on
    CUDA): each tensor is copied into the buffer its file and place in the state held at the last save when its
    shape, dtype and strides are the same (a new one otherwise). At most one save is in flight (saves.py waits
    for it before the next), and `copier` refuses while the last save's writer has not finished (`release`),
    so no buffer is overwritten while it is being written. `allocated`: buffers made so far."""

    def __init__(self, pin=False):
        self.pin, self.kept, self.in_use, self.allocated = pin, {}, False, 0

    def copier(self):
        """The copy function of one save: copier()(state, path) -> the state in host buffers."""
        if self.in_use:
            raise RuntimeError("host buffers reused while the last background save's writer is still writing")
        self.in_use = True
        return self.copy

    def copy(self, state, path):
        name, place = os.path.basename(path), itertools.count()
        return _rebuild(state, lambda t: self._into((name, next(place)), t))

    def release(self):
        self.in_use = False

    def _into(self, key, t):
        import torch
        t = t.detach()
        signature = (t.shape, t.dtype, t.stride())
        kept = self.kept.get(key)
        if kept is None or kept[0] != signature:
            kept = self.kept[key] = (signature, torch.empty_like(t, device="cpu", pin_memory=self.pin))
            self.allocated += 1
        kept[1].copy_(t, non_blocking=self.pin and t.device.type != "cpu")
        return kept[1]


def _rebuild(obj, copy):
    """`obj` with every tensor replaced by copy(tensor), containers rebuilt, other values shared."""
    import torch
    if isinstance(obj, torch.Tensor):
        return copy(obj)
    if isinstance(obj, dict):
        items = [(k, _rebuild(v, copy)) for k, v in obj.items()]
        try:
            return type(obj)(items)
        except TypeError:  # a dict subclass built otherwise (defaultdict)
            return dict(items)
    if isinstance(obj, (list, tuple)):
        items = [_rebuild(v, copy) for v in obj]
        if hasattr(obj, "_fields"):
            return type(obj)(*items)
        return type(obj)(items)
    return obj


def tensor_bytes(obj):
    """The bytes of the tensors in `obj` (what its host copy holds)."""
    import torch
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def _fsync_dir(path):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class Job:
    """One rank's background write of one step: the collected files, written in order by `run` on a thread.
    After it: `entries` {file in the step folder: manifest entry}, `bytes`, `seconds` (writing), `error` (what
    it raised other than running out of room, re-raised by the committing thread), `probe` (see save_stats)."""

    def __init__(self, iteration, step_dir, collector, rank, probe=None, buffers=None):
        self.iteration, self.step_dir, self.rank, self.buffers = iteration, step_dir, rank, buffers
        self.files, self.zipfile = collector.files, collector.zipfile_serialization
        self.host_bytes = sum(tensor_bytes(state) for _, state in self.files)
        self.probe_fn = probe
        self.entries, self.bytes, self.seconds, self.error, self.probe = {}, 0, 0.0, None, None
        self.thread = threading.Thread(target=self.run, name=f"checkpoint-writer-{iteration}", daemon=True)

    def start(self):
        self.thread.start()
        return self

    def run(self):
        try:
            kill_points.maybe_kill("copied", self.iteration, self.rank)
            if self.probe_fn is not None:
                self.probe = self.probe_fn()
            time.sleep(float(os.environ.get(DELAY_ENV) or 0))
            start = time.perf_counter()
            for n, (path, state) in enumerate(self.files):
                _, size, crc = checkpoint_engine.write_background(state, path, self.zipfile)
                if n == 0:
                    kill_points.maybe_kill("writing", self.iteration, self.rank)
                if size:
                    self.bytes += size
                    rel = os.path.relpath(path, self.step_dir)
                    if not rel.startswith(".."):
                        self.entries[rel] = entry(path) if crc is None else {"size": size, "crc32": f"{crc:08x}"}
            _fsync_dir(self.step_dir)
            kill_points.maybe_kill("written", self.iteration, self.rank)
            self.seconds = time.perf_counter() - start
        except BaseException as e:  # noqa: BLE001 - handed to the training thread, which raises it
            self.error = e
        finally:
            self.files = None  # the host copies go (or wait in `buffers` for the next save)
            if self.buffers is not None:
                self.buffers.release()

    def done(self):
        return not self.thread.is_alive()

    def join(self):
        self.thread.join()
