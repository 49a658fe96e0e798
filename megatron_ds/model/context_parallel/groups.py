"""The context-parallel process group: registered once by the runtime that builds the groups, asked for by the
layers whose GPTConfig says context_parallel_size > 1 (as tensor_parallel_group is for TP).

Under --cp-comm-type a2a+p2p the runtime also registers the group's two levels (Megatron-core's hierarchical
context parallelism, --hierarchical-context-parallel-sizes A P): the inner group, the A consecutive CP ranks the
all-to-all runs over, and the outer group, the P ranks with this rank's position in their inner groups (CP ranks
a, a + A, a + 2A, ...), the ring's."""
_GROUP = None
_SIZE = 1
_LEVELS = None  # (inner group, outer group, (A, P)) under a2a+p2p


def set_context_parallel_group(group, size: int, levels=None, sizes=None) -> None:
    """Register the CP group of this process (`size` ranks; None and 1 to clear it) and, for a2a+p2p, its
    `levels` (inner group, outer group) of `sizes` (A, P)."""
    global _GROUP, _SIZE, _LEVELS
    _GROUP, _SIZE = group, size
    _LEVELS = None if levels is None else (*levels, tuple(sizes))


def context_parallel_group(config):
    """The group `config`'s attention exchanges keys and values over: None when it asks for no CP."""
    cp = getattr(config, "context_parallel_size", 1)
    if cp == 1:
        return None
    if _GROUP is None or _SIZE != cp:
        raise RuntimeError(f"the model asks for context parallelism {cp}, the registered context-parallel group "
                           f"has {_SIZE if _GROUP is not None else 'not been made'}")
    return _GROUP


def context_parallel_levels(sizes=None):
    """(inner group, outer group) of the registered CP group: a2a+p2p's all-to-all and ring groups; `sizes`
    (A, P), when given, must be the registered ones."""
    if _LEVELS is None:
        raise RuntimeError("--cp-comm-type a2a+p2p: no inner and outer context-parallel groups were registered "
                           "(--hierarchical-context-parallel-sizes)")
    if sizes is not None and tuple(sizes) != _LEVELS[2]:
        raise RuntimeError(f"the model asks for --hierarchical-context-parallel-sizes {' '.join(map(str, sizes))}, "
                           f"the registered groups are {' '.join(map(str, _LEVELS[2]))}")
    return _LEVELS[:2]


def context_parallel_registered() -> bool:
    """Whether the runtime has registered a CP group in this process."""
    return _GROUP is not None
