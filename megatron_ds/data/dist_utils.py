"""The little torch.distributed that the data and training layers need: who prints, rank 0
builds, everyone waits.

torch.distributed is imported on first use, so that preprocessing and `--help` stay fast.
"""
import os


def _dist():
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist
    return None


def get_rank():
    dist = _dist()
    return dist.get_rank() if dist else 0


def rank_and_world():
    """The process group's, or before it exists the launcher's (RANK, WORLD_SIZE)."""
    dist = _dist()
    if dist:
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def barrier():
    # A plain barrier works on gloo and nccl alike (Megatron's all-reduce trick was CUDA-only).
    dist = _dist()
    if dist:
        dist.barrier()


def print_rank_0(message):
    if rank_and_world()[0] == 0:
        print(message, flush=True)
