"""The context-parallel process group: registered once by the runtime that builds the groups, asked for by the
layers whose GPTConfig says context_parallel_size > 1 (as tensor_parallel_group is for TP)."""
_GROUP = None
_SIZE = 1


def set_context_parallel_group(group, size: int) -> None:
    """Register the CP group of this process (`size` ranks; None and 1 to clear it)."""
    global _GROUP, _SIZE
    _GROUP, _SIZE = group, size


def context_parallel_group(config):
    """The group `config`'s attention exchanges keys and values over: None when it asks for no CP."""
    cp = getattr(config, "context_parallel_size", 1)
    if cp == 1:
        return None
    if _GROUP is None or _SIZE != cp:
        raise RuntimeError(f"the model asks for context parallelism {cp}, the registered context-parallel group "
                           f"has {_SIZE if _GROUP is not None else 'not been made'}")
    return _GROUP


def context_parallel_registered() -> bool:
    """Whether the runtime has registered a CP group in this process."""
    return _GROUP is not None
