"""Work over the ranks' files, shared out and gathered back, for the checks every rank runs at once
(manifests, safe loading): each rank takes its share of one list, and all see every rank's findings.
Without a process group (or with one rank) each is the identity."""


def _group_size():
    import torch.distributed as dist  # lazy: the file tools use this without torch.distributed started
    return dist.get_world_size() if dist.is_initialized() else 1


def from_rank0(fn):
    """fn() on rank 0, its value on every rank (one list, even where a shared file system lags)."""
    import torch.distributed as dist
    if _group_size() == 1:
        return fn()
    box = [fn() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def share(items):
    """This rank's share of `items`: r, r + world, ..."""
    import torch.distributed as dist
    if not dist.is_initialized():
        return items
    return items[dist.get_rank()::dist.get_world_size()]


def gather(item):
    """[every rank's item], in rank order."""
    import torch.distributed as dist
    if _group_size() == 1:
        return [item]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, item)
    return out
