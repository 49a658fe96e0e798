"""The little torch.distributed the data layer needs: rank 0 builds, everyone waits.

torch is imported lazily so preprocessing tools never pay for it.
"""


def _dist():
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if dist.is_available() and dist.is_initialized():
        return dist
    return None


def get_rank():
    dist = _dist()
    return dist.get_rank() if dist else 0


def barrier():
    # A plain barrier works on gloo and nccl alike (Megatron's all-reduce trick was CUDA-only).
    dist = _dist()
    if dist:
        dist.barrier()


def print_rank_0(message):
    if get_rank() == 0:
        print(message, flush=True)
