"""The checkpoint engine DeepSpeed reads and writes our model and optimizer files through.

DeepSpeed lets the engine be chosen (engine.checkpoint_engine; its pipeline module and state-dict loaders
take it from there). Ours is its TorchCheckpointEngine with two changes: load is weights-only with our
allow-list (safe_load.py), and save records running out of disk instead of raising half-way through
DeepSpeed's save (disk_full.py), so that every rank reaches the save's collectives.
"""
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

from ..faults import disk_full

from . import safe_load


class MegatronDSCheckpointEngine(TorchCheckpointEngine):

    def save(self, state_dict, path):
        disk_full.write_torch(state_dict, path, _use_new_zipfile_serialization=self.zipfile_serialization)

    def load(self, path, map_location=None):
        return safe_load.load(path, map_location=map_location)


def install(engine):
    """Put ours in place of DeepSpeed's default engine (same settings). A configured writer (fast,
    decoupled) keeps its own; safe_load.weights_only_everywhere still covers its loads."""
    if type(engine.checkpoint_engine) is TorchCheckpointEngine:
        engine.checkpoint_engine.__class__ = MegatronDSCheckpointEngine
    return engine.checkpoint_engine
