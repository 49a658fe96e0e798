"""Activation recomputation replays the tensor-parallel dropout masks of the forward.

DeepSpeed's activation checkpointing (the PipelineModule's checkpoint function) saves and restores
DeepSpeed's RNG tracker, so a recomputed layer must draw its partitioned masks from that tracker:
otherwise its backward uses masks the forward never applied and every gradient is wrong."""
import torch
from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing

from megatron_ds.model.tensor_parallel import model_parallel_manual_seed
from megatron_ds.model.tensor_parallel.rng import Dropout


def _run(recompute):
    model_parallel_manual_seed(7, tensor_parallel_rank=0)
    x = torch.linspace(0.5, 2.0, 4096, requires_grad=True)
    replicated, partitioned = Dropout(0.5), Dropout(0.5, partitioned=True)
    layer = lambda t: partitioned(replicated(t) * t)  # noqa: E731
    y = ds_checkpointing.checkpoint(layer, x) if recompute else layer(x)
    (y * torch.arange(4096.0)).sum().backward()
    return y.detach(), x.grad


def test_recomputed_partitioned_and_replicated_dropout_replay_the_forward_masks():
    y, grad = _run(recompute=False)
    y_re, grad_re = _run(recompute=True)
    assert 0.3 < (y == 0).float().mean() < 0.9  # both masks drop
    assert torch.equal(y, y_re)
    assert torch.equal(grad, grad_re)


def test_the_tensor_parallel_rank_picks_the_partitioned_stream():
    masks = []
    for rank in (0, 1):
        model_parallel_manual_seed(7, tensor_parallel_rank=rank)
        masks.append(Dropout(0.5, partitioned=True)(torch.ones(256)) == 0)
    assert not torch.equal(*masks)
