"""Named RNG states for tensor-parallel dropout (Megatron's CudaRNGStatesTracker), on CPU or CUDA.

Replicated regions (the residual stream without sequence parallelism) must drop the same
elements on every tensor-parallel rank, so they draw from the default generator, seeded
alike on those ranks. Partitioned regions (attention heads, sequence-parallel shards)
must drop different elements, so they draw inside `tracker.fork()` from a state seeded
per tensor-parallel rank. A fork leaves the default generator where it was.
"""
from contextlib import contextmanager

import torch

MODEL_PARALLEL_RNG = "model-parallel-rng"
_TP_SEED_OFFSET = 2718  # Megatron's, so seeds match its runs


def _get_state(device):
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_state(device, state):
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:

    def __init__(self):
        self.states = {}  # name -> (device, state)

    def reset(self):
        self.states = {}

    def add(self, name, seed, device="cpu"):
        if name in self.states:
            raise ValueError(f"RNG state {name} already exists")
        device = torch.device(device)
        self.states[name] = (device, torch.Generator(device).manual_seed(seed).get_state())

    def get_states(self):
        """A copy to restore with set_states (activation recomputation replays the same masks)."""
        return {name: (device, state.clone()) for name, (device, state) in self.states.items()}

    def set_states(self, states):
        self.states = {name: (device, state.clone()) for name, (device, state) in states.items()}

    @contextmanager
    def fork(self, name=MODEL_PARALLEL_RNG):
        if name not in self.states:
            raise ValueError(f"RNG state {name} is not added (call model_parallel_manual_seed first)")
        device, state = self.states[name]
        saved = _get_state(device)
        _set_state(device, state)
        try:
            yield
        finally:
            self.states[name] = (device, _get_state(device))
            _set_state(device, saved)


_TRACKER = RNGStatesTracker()


def get_rng_tracker():
    return _TRACKER


def model_parallel_manual_seed(seed, tensor_parallel_rank, device="cpu"):
    """Default generator: `seed` (alike on a tensor-parallel group); the tracker's model-parallel
    state: seed + 2718 + tensor-parallel rank (distinct within the group)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + _TP_SEED_OFFSET + tensor_parallel_rank, device)


def partitioned_dropout(x, p, training):
    """Dropout on a tensor split over the tensor-parallel ranks (heads, sequence shards): each rank's
    own mask, from the tracker's model-parallel state."""
    if not training or p == 0.0:
        return x
    with _TRACKER.fork():
        return torch.nn.functional.dropout(x, p, training=True)


class Dropout(torch.nn.Dropout):
    """nn.Dropout that, on a partitioned tensor, draws its mask from the model-parallel RNG state."""

    def __init__(self, p, partitioned=False):
        super().__init__(p)
        self.partitioned = partitioned

    def forward(self, x):
        if self.partitioned:
            return partitioned_dropout(x, self.p, self.training)
        return super().forward(x)
