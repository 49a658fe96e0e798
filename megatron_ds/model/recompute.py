"""Selective recompute (Megatron's --recompute-granularity selective): the attention core attended again in
backward instead of kept.

The core is what lies between the projections: scores, softmax, dropout and the weighted sum of the values.
Unfused (attention dropout or an additive bias on CPU, Megatron's own kernel) it keeps (s x s) tensors per
head for backward, the largest activations of a layer at long sequences; fused (flash) its output and the
softmax statistics. Under selective recompute a layer keeps only the core's inputs q, k, v, which it keeps
anyway, and everything else of the layer as before: the core runs once more in backward, its cheapest part
in FLOPs (Korthikanti et al. 2022, "Reducing activation recomputation in large transformer models").

The recomputation is DeepSpeed's checkpoint, as a whole recomputed layer's (--recompute-granularity full):
it restores the CPU, the accelerator's and the tensor-parallel tracker's RNG states, so the recomputed
dropout masks are the forward's. It runs no linear layer, so a B/W split's deferred weight GEMMs
(linear.WeightGradStore) are untouched, and a Seq1F1B segment's keys and values are the K/V cache's views
(kv_cache.py), which later segments never write. A compiled layer leaves it out of its graph (the checkpoint
cannot live inside one): the layer is two graphs around it.
"""
import torch
from deepspeed.runtime.activation_checkpointing.checkpointing import checkpoint

from .compile import outside_graph


@outside_graph
def recomputed(core, q, k, v):
    """core(q, k, v), keeping only q, k and v for backward when autograd records (else as it is)."""
    if not torch.is_grad_enabled():
        return core(q, k, v)
    return checkpoint(core, q, k, v)
