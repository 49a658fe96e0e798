"""The runtime's side of the MoE layers, for every engine (DeepSpeed's stock one and ours).

Before a step's backward passes the router losses learn the factor the engine scales a micro-batch's
loss by (model/moe.set_grad_scale); after the optimizer step every router with an expert bias moves it
from the step's token counts summed over the ranks that routed the rest of the stage's global batch:
the data-parallel group, and the tensor-parallel one when each of its ranks routes a sequence shard.
"""
import functools

import torch.distributed as dist

from megatron_ds.model.moe import set_grad_scale
from megatron_ds.model.moe_router import Router
from megatron_ds.model.tensor_parallel import get_parallel_state


def routers(module):
    return [m for m in module.modules() if isinstance(m, Router)]


def router_grad_scale(engine) -> float:
    """What the engine multiplies a micro-batch's loss by before its backward: 1 / micro-batches, and
    fp16's loss scale (bf16 and fp32 have none)."""
    loss_scale = getattr(engine.optimizer, "loss_scale", 1.0) if engine.fp16_enabled() else 1.0
    return float(loss_scale) / engine.micro_batches


class RouterStep:
    """A mixin before a PipelineEngine class (with_router_step)."""

    def _exec_schedule(self, pipe_schedule):
        set_grad_scale(router_grad_scale(self))
        return super()._exec_schedule(pipe_schedule)

    def _take_model_step(self, lr_kwargs):
        out = super()._take_model_step(lr_kwargs)
        groups = [self.grid.get_data_parallel_group()]
        if any(getattr(p, "sequence_parallel", False) for r in routers(self.module) for p in r.parameters()):
            groups.append(get_parallel_state().get_tensor_model_parallel_group())
        for router in routers(self.module):
            for group in groups[1:]:
                if router.tokens_per_expert is not None:
                    dist.all_reduce(router.tokens_per_expert, group=group)
            router.update_expert_bias(groups[0])
        return out


@functools.lru_cache(maxsize=None)
def with_router_step(engine_class):
    """engine_class with RouterStep in front (one class per engine class)."""
    return type(engine_class.__name__, (RouterStep, engine_class), {"__doc__": engine_class.__doc__})
