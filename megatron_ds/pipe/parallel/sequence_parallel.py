"""Megatron's sequence parallelism in the pipeline engines: what the engine adds to what the layers do.

With `GPTConfig.sequence_parallel` the residual stream between layers is this tensor rank's shard of
the sequence, (b, s / TP, h) (a Seq1F1B segment's tokens split the same way), so the messages between
stages are TP times smaller (PipelinePlan.message_shape). The norms and the row-parallel biases act on
the shard: each TP rank's gradient covers its own tokens, and the sum over the TP group is the gradient
(layers.py marks them `sequence_parallel`). The engine sums them once per step, after every backward and
deferred weight-gradient (W) op and the twin-chunk sync, and before the tied-weight, data-parallel/ZeRO
reduction and the gradient norm (Megatron's finalize_model_grads). The summed gradients are then equal
on the TP ranks, so they count once in the norm, like any replicated parameter. The per-head query/key norms
of --qk-layernorm (model/norm.HeadNorm, marked `tensor_parallel_partial`) join the same sum with or without
sequence parallelism: each rank's gradient covers its own heads.
"""
import torch.distributed as dist
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.schedule import ReduceTiedGrads
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megatron_ds.model.tensor_parallel import get_parallel_state

from ..deepspeed import ds_internals as ds


def sequence_parallel_params(module):
    """The module's parameters whose gradient a TP rank holds a share of: marked `sequence_parallel` (a sequence
    shard's) or `tensor_parallel_partial` (its heads'); parameters() yields a shared one once."""
    return [p for p in module.parameters()
            if getattr(p, "sequence_parallel", False) or getattr(p, "tensor_parallel_partial", False)]


def on_sequence_shards(module):
    """Whether the module's activations are sequence shards (a parameter marked `sequence_parallel`)."""
    return any(getattr(p, "sequence_parallel", False) for p in module.parameters())


def reduce_sequence_parallel_grads(engine):
    """All-reduce (sum) the sequence-parallel gradients over the tensor-parallel group, in one message.
    bf16: DeepSpeed's optimizer holds the gradients in fp32 (`_hp_grad`), as its tied-weight sum reads them."""
    params = sequence_parallel_params(engine.module)
    if not params:
        return
    bf16 = engine.using_bf16_optimizer
    grads = [g for g in ((ds.fp32_grad(p) if bf16 else p.grad) for p in params) if g is not None]
    if not grads:
        return
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=get_parallel_state().get_tensor_model_parallel_group())
    for g, summed in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(summed)


def with_sequence_parallel_reduction(instruction_map):
    """`instruction_map` whose ReduceTiedGrads first sums the sequence-parallel gradients (a no-op without)."""
    tied = instruction_map[ReduceTiedGrads]

    def reduce_tied_grads(engine):
        reduce_sequence_parallel_grads(engine)
        tied(engine)

    return {**instruction_map, ReduceTiedGrads: reduce_tied_grads}


class SequenceParallelPipelineEngine(PipelineEngine):
    """DeepSpeed's stock engine (TrainSchedule, 1F1B), plus the sequence-parallel gradient sum."""
    _INSTRUCTION_MAP = with_sequence_parallel_reduction(ds.instruction_map(PipelineEngine))
