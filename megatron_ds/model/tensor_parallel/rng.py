"""The RNG streams of tensor-parallel dropout, in DeepSpeed's CudaRNGStatesTracker (CPU or CUDA).

Replicated regions (the residual stream without sequence parallelism) must drop the same
elements on every tensor-parallel rank, so they draw from the default generator, seeded
alike on those ranks. Partitioned regions (attention heads, sequence-parallel shards)
must drop different elements, so they draw inside `tracker.fork()` from a state seeded
per tensor-parallel rank. A fork leaves the default generator where it was.
"""
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.activation_checkpointing.checkpointing import get_cuda_rng_tracker

MODEL_PARALLEL_RNG = "model-parallel-rng"
_TP_SEED_OFFSET = 2718  # Megatron's, so seeds match its runs


def get_rng_tracker():
    """DeepSpeed's tracker (its accelerator's generator: CPU here, CUDA on GPUs), because DeepSpeed's
    activation checkpointing saves and restores exactly that one: a recomputed layer replays the masks
    of its forward."""
    return get_cuda_rng_tracker()


def model_parallel_manual_seed(seed, tensor_parallel_rank):
    """Default generators: `seed` (alike on a tensor-parallel group); the tracker's model-parallel
    state: seed + 2718 + tensor-parallel rank (distinct within the group)."""
    torch.manual_seed(seed)
    get_accelerator().manual_seed(seed)
    tracker = get_rng_tracker()
    tracker.reset()
    tracker.add(MODEL_PARALLEL_RNG, seed + _TP_SEED_OFFSET + tensor_parallel_rank)


def partitioned_dropout(x, p, training):
    """Dropout on a tensor split over the tensor-parallel ranks (heads, sequence shards): each rank's
    own mask, from the tracker's model-parallel state."""
    if not training or p == 0.0:
        return x
    with get_rng_tracker().fork(MODEL_PARALLEL_RNG):
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
