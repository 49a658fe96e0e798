"""The checkpoint engines DeepSpeed reads and writes our model and optimizer files through.

DeepSpeed lets the engine be chosen (engine.checkpoint_engine; its pipeline module and state-dict loaders
take it from there). Ours is its TorchCheckpointEngine with two changes: load is weights-only with our
allow-list (safe_load.py), and save records running out of disk instead of raising half-way through
DeepSpeed's save (disk_full.py), so that every rank reaches the save's collectives. Each file written is
timed and sized (`written`, the save's log line). Under --async-save the save goes through a `Collector`
for the length of DeepSpeed's save_checkpoint (`writing_through`): it copies each state to host memory and
hands the copies to the background writer (async_save.py) instead of writing them.
"""
import contextlib
import os
import time

from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

from ..faults import disk_full

from . import safe_load, zip_writer

# (path, seconds, bytes) of each file this rank's synchronous save wrote; the saver empties it per save
written = []


def write_file(state_dict, path, zipfile_serialization):
    """torch.save through disk_full (fsynced); returns (seconds, bytes), bytes 0 when it ran out of room."""
    start = time.perf_counter()
    disk_full.write_torch(state_dict, path, _use_new_zipfile_serialization=zipfile_serialization)
    size = os.path.getsize(path) if os.path.exists(path) else 0
    return time.perf_counter() - start, size


def write_background(state_dict, path, zipfile_serialization):
    """The background writer's write_file: torch.save's format through zip_writer (the GIL held little), its
    CRC-32 taken while writing. Returns (seconds, bytes, crc32 or None), bytes 0 when it ran out of room."""
    if not zipfile_serialization:  # the legacy format: torch's own writer
        return (*write_file(state_dict, path, zipfile_serialization), None)
    start, files = time.perf_counter(), []

    def save(obj, raw):
        files.append(zip_writer.CrcFile(raw))
        zip_writer.save(obj, files[-1])

    disk_full.write_torch(state_dict, path, save=save)
    size = os.path.getsize(path) if os.path.exists(path) else 0
    return time.perf_counter() - start, size, files[-1].crc if size and files else None


class MegatronDSCheckpointEngine(TorchCheckpointEngine):

    def save(self, state_dict, path):
        written.append((path, *write_file(state_dict, path, self.zipfile_serialization)))

    def load(self, path, map_location=None):
        return safe_load.load(path, map_location=map_location)


class Collector(CheckpointEngine):
    """DeepSpeed's checkpoint engine API, for one save under --async-save: `save` copies the state to host
    memory (`copy(state, path)`: async_save.HostBuffers.copy) and keeps it with its path; nothing is written. DeepSpeed's own
    clone before a save is skipped (preserves_storage_sharing): the host copy is one already."""

    def __init__(self, like, copy):
        super().__init__()
        self.name = "MegatronDSCollector"
        self.zipfile_serialization = like.zipfile_serialization
        self.copy, self.files = copy, []

    def create(self, info):
        pass

    def save(self, state_dict, path):
        self.files.append((path, self.copy(state_dict, path)))

    def load(self, path, map_location=None):
        raise RuntimeError("the async-save collector writes nothing and loads nothing")

    def commit(self, info):
        return True  # ours comes later, once every rank's writer is done (saves.py)

    def preserves_storage_sharing(self):
        return False


def install(engine):
    """Put ours in place of DeepSpeed's default engine (same settings). A configured writer (fast,
    decoupled) keeps its own; safe_load.weights_only_everywhere still covers its loads."""
    if type(engine.checkpoint_engine) is TorchCheckpointEngine:
        engine.checkpoint_engine.__class__ = MegatronDSCheckpointEngine
    return engine.checkpoint_engine


@contextlib.contextmanager
def writing_through(engine, collector):
    """DeepSpeed's save goes through `collector` (None: the engine's own) while the block runs."""
    if collector is None:
        yield
        return
    own = engine.checkpoint_engine
    engine.checkpoint_engine = collector
    try:
        yield
    finally:
        engine.checkpoint_engine = own
