"""The runtime's side of the MoE layers, for every engine (DeepSpeed's stock one and ours).

Before a step's backward passes the router losses learn the factor the engine scales a micro-batch's
loss by (model/moe.set_grad_scale); after the optimizer step every router with an expert bias moves it
from the step's token counts summed over the ranks that routed the rest of the stage's global batch:
the data-parallel group, and the tensor-parallel one when each of its ranks routes a sequence shard.
"""
import functools

import torch.distributed as dist

from deepspeed.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer

from megatron_ds.model.moe import MoE, RouterLossLog, set_grad_scale
from megatron_ds.model.moe_dispatch import group_name
from megatron_ds.model.moe_router import Router
from megatron_ds.model.tensor_parallel import get_parallel_state
from megatron_ds.moe_config import expert_parallel_problem

from ..deepspeed import ds_internals as ds
from ..plan.config import ConfigError
from ..parallel.context_parallel import context_parallel_size
from .moe_checkpoint import check_layer_writes, dense_checkpoint, whole_experts


def routers(module):
    return [m for m in module.modules() if isinstance(m, Router)]


def routes_shards(routers_):
    """Whether the routers see a sequence shard each (sequence parallelism): their tensor-parallel ranks route
    different tokens, whose counts add up."""
    return any(getattr(p, "sequence_parallel", False) for r in routers_ for p in r.parameters())


def router_grad_scale(engine) -> float:
    """What the engine multiplies a micro-batch's loss by before its backward: 1 / micro-batches, and
    fp16's loss scale (bf16 and fp32 have none); under context parallelism x CP, as a rank's share of the
    language-model loss is (pipe/parallel/context_parallel.py): DeepSpeed averages the shares over DP x CP."""
    loss_scale = getattr(engine.optimizer, "loss_scale", 1.0) if engine.fp16_enabled() else 1.0
    return float(loss_scale) * context_parallel_size(engine.module) / engine.micro_batches


def ensure_expert_parallel(config, topo):
    """The expert-parallel and expert-data-parallel groups of `config`'s MoE layers in DeepSpeed's registry
    (collective: every rank, before the model is built; nothing without expert parallelism). `topo`: the
    pipeline's ProcessTopology. For each stage and TP rank, consecutive data-parallel ranks form an EP group
    and ranks EP apart an EDP group. DeepSpeed's own maker matches this without TP; with TP it would put
    TP ranks, which route the same tokens, in one EDP group (DeepSpeed's registries, which its ZeRO optimizer
    reads: ds_internals.expert_parallel_registries)."""
    moe = getattr(config, "moe", None)
    if moe is None or moe.expert_model_parallel_size == 1:
        return
    ep, name = moe.expert_model_parallel_size, group_name(moe.expert_model_parallel_size)
    problem = expert_parallel_problem(ep, topo.get_dim("data"))
    if problem:
        raise ConfigError(problem)
    ep_groups, ep_ranks, edp_groups, edp_ranks = ds.expert_parallel_registries()
    if name in ep_groups:
        return
    me = dist.get_rank()
    for lane in topo.get_axis_comm_lists("data"):  # one stage and TP rank's data-parallel ranks, in order
        for registry, ranks_registry, cut in (
                (ep_groups, ep_ranks, [lane[i:i + ep] for i in range(0, len(lane), ep)]),
                (edp_groups, edp_ranks, [lane[j::ep] for j in range(ep)])):
            for ranks in cut:
                group = dist.new_group(ranks)
                if me in ranks:
                    registry[name], ranks_registry[name] = group, ranks


def optimizer_param_groups(param_groups):
    """The optimizer's parameter groups with expert-parallel parameters in groups of their own (DeepSpeed's
    split: ZeRO reduces and partitions each over its expert-data-parallel group); unchanged without them.
    Each group needs a distinct "name"."""
    if not any(is_moe_param(p) for g in param_groups for p in g["params"]):
        return param_groups
    return split_params_into_different_moe_groups_for_optimizer(param_groups)


class RouterStep:
    """A mixin before a PipelineEngine class (with_router_step). After each train_batch, `router_metrics`
    holds the step's router_metrics. Checkpoints are those of the model without expert parallelism
    (moe_checkpoint.py)."""
    router_metrics = None

    def train_batch(self, data_iter=None):
        RouterLossLog.take()  # what an evaluation's or a failed step's passes left
        loss = super().train_batch(data_iter)
        self.router_metrics = router_metrics(self)
        return loss

    def _configure_distributed_model(self, model):
        """DeepSpeed knows its own MoE class only: a stage holding expert-parallel parameters says so here, before
        the optimizer is made (ZeRO then takes their expert-data-parallel groups). The routers are found once."""
        super()._configure_distributed_model(model)
        self.routers = routers(self.module)
        moe = {m.config.num_experts for m in self.module.modules() if isinstance(m, MoE) and m.ep_group is not None}
        if moe:
            self.has_moe_layers = True
            self.num_experts = sorted(moe)
            check_layer_writes(self.module)

    def save_checkpoint(self, *args, **kwargs):
        with whole_experts(self), dense_checkpoint(self):
            return super().save_checkpoint(*args, **kwargs)

    def load_checkpoint(self, *args, **kwargs):
        with dense_checkpoint(self):
            return super().load_checkpoint(*args, **kwargs)

    def _exec_schedule(self, pipe_schedule):
        set_grad_scale(router_grad_scale(self))
        return super()._exec_schedule(pipe_schedule)

    def _take_model_step(self, lr_kwargs):
        out = super()._take_model_step(lr_kwargs)
        shards = get_parallel_state().get_tensor_model_parallel_group() if routes_shards(self.routers) else None
        for router in self.routers:
            if shards is not None and router.tokens_per_expert is not None:
                dist.all_reduce(router.tokens_per_expert, group=shards)
            router.update_expert_bias(self.grid.get_data_parallel_group())
        return out


def router_metrics(engine):
    """{"load_balancing_loss", "z_loss": each the mean over the model's MoE layers of its per-micro-batch
    mean; "expert_load": {layer: the most tokens an expert got / the mean}} of the step, from every rank's
    backward passes (stages hold different layers, data-parallel ranks other tokens, tensor-parallel ranks
    the same tokens, or with sequence parallelism their shards). Every rank gets the same values."""
    sums, loads = RouterLossLog.take()
    counted = routes_shards(engine.routers) or engine.grid.get_slice_parallel_rank() == 0
    mine = ({k: float(v) for k, v in sums.items()}, {k: v.tolist() for k, v in loads.items()}) if counted else ({}, {})
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    total_sums, total_loads = {}, {}
    for rank_sums, rank_loads in everyone:
        for k, v in rank_sums.items():
            total_sums[k] = total_sums.get(k, 0.0) + v
        for layer, counts in rank_loads.items():
            old = total_loads.get(layer, [0.0] * len(counts))
            total_loads[layer] = [a + b for a, b in zip(old, counts)]
    replicas = engine.grid.get_data_parallel_world_size() // context_parallel_size(engine.module)  # CP: shares
    per_micro_batch = engine.micro_batches * replicas * max(1, len(total_loads))
    metrics = {k: v / per_micro_batch for k, v in total_sums.items()}
    metrics["expert_load"] = {layer: max(c) / (sum(c) / len(c)) for layer, c in sorted(total_loads.items()) if sum(c)}
    return metrics


@functools.lru_cache(maxsize=None)
def with_router_step(engine_class):
    """engine_class with RouterStep in front (one class per engine class)."""
    return type(engine_class.__name__, (RouterStep, engine_class), {"__doc__": engine_class.__doc__})
