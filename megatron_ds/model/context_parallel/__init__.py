"""Context parallelism (CP): one sequence split over CP ranks, attention exchanging keys and values.

Read in this order: layout (which tokens a CP rank holds: Megatron-core's 2 x CP load-balanced chunks),
groups (the CP process group the runtime registers and attention asks for), attend (the attention layer's one entry:
CP attention by --cp-comm-type), then one module per comm type: ring (p2p, over blocks.py's block attention with
log-sum-exp merging), allgather, a2a (Ulysses); a2a+p2p (hierarchical: a2a.py's exchange within groups of A
ranks, then the ring over the P groups) is attend.py's composition of the two.
"""
from .groups import context_parallel_group, context_parallel_levels, context_parallel_registered, \
    set_context_parallel_group
from .layout import ContextLayout, layout_problem
