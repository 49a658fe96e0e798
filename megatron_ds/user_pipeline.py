"""megatron_ds.initialize: deepspeed.initialize, with our schedules for a user's own PipelineModule.

Same arguments and return values as deepspeed.initialize. A PipelineModule and a ds_config whose
"pipeline.schedule" names a schedule get our engine (pipe/foreign/foreign_engine.py) over the module's layers cut into
the schedule's chunks (pipe/foreign/foreign.py); anything else goes to deepspeed.initialize untouched, DeepSpeed's
own engine included. Under the ds_config's "context_parallel" section the sequence is split over the CP ranks
(pipe/foreign/foreign_context.py). The module is built again for the chunks, so what was bound to its parameters is
bound again to the new ones by parameter name: `model_parameters` (parameters or param groups), an optimizer
object (rebuilt with its defaults and each param group's settings); an lr scheduler object, bound to the old
optimizer, cannot be, so a scheduler comes as a callable or from the ds_config. Expert-parallel parameters of
MoE layers go to param groups of their own, as DeepSpeed's ZeRO asks (pipe/foreign/foreign_moe.py).
"""
import copy
import inspect
import types

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.constants import TORCH_DISTRIBUTED_DEFAULT_PORT
from deepspeed.pipe import PipelineModule
from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config

from megatron_ds.pipe.build import initialize_engine
from megatron_ds.pipe.plan.config import ConfigError, pipeline_settings
from megatron_ds.pipe.foreign.foreign import check_parameters, check_settings, chunked, partition_method, plan_for
from megatron_ds.pipe.foreign.foreign_context import check_layers, check_run, context_settings
from megatron_ds.pipe.foreign.foreign_engine import ForeignScheduleEngine
from megatron_ds.pipe.foreign.foreign_moe import check_experts, expert_groups, has_experts, module_groups
from megatron_ds.pipe.parallel.context_parallel import ensure_context_parallel


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None, lr_scheduler=None,
               distributed_port=TORCH_DISTRIBUTED_DEFAULT_PORT, mpu=None, dist_init_required=None, collate_fn=None,
               config=None, mesh_param=None, config_params=None):
    """deepspeed.initialize's (engine, optimizer, training_dataloader, lr_scheduler)."""
    given = dict(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                 training_data=training_data, lr_scheduler=lr_scheduler, distributed_port=distributed_port, mpu=mpu,
                 dist_init_required=dist_init_required, collate_fn=collate_fn, config=config, mesh_param=mesh_param,
                 config_params=config_params)
    ds_config = _ds_config(args, config if config is not None else config_params)
    settings = pipeline_settings(ds_config or {})
    cp, cp_comm = context_settings(ds_config or {})
    check_run(cp, settings.stock, training_data)
    if settings.stock:
        return deepspeed.initialize(**given)
    if not isinstance(model, PipelineModule):
        raise ConfigError(f'ds_config "pipeline.schedule" = {settings.schedule!r} runs a deepspeed.pipe.PipelineModule; '
                          f"the model is a {type(model).__name__}")
    check_settings(settings, ds_config)
    plan = plan_for(model, ds_config, settings, cp=cp)
    method = partition_method(model, ds_config, plan.schedule.stages)
    if optimizer is not None or "optimizer" in ds_config:  # DeepSpeed builds one on every rank
        check_parameters(model, plan, method)
    # the CP group registered before the chunks are built: their attention takes it (pipe/foreign/foreign_context.py)
    context = ensure_context_parallel(types.SimpleNamespace(context_parallel_size=cp), model.topology()) \
        if cp > 1 else None
    module = chunked(model, plan, method, seed_layers=ds_config["pipeline"].get("seed_layers", False))
    check_layers(module, cp, cp_comm)
    check_experts(module, model.topology())  # the EP groups the user made are the topology's
    module.context_layout = context  # the engine cuts each micro-batch to this rank's tokens (or None)
    optimizer, model_parameters = _rebound(model, module, optimizer, model_parameters, lr_scheduler)
    engine = initialize_engine(module, ds_config, optimizer, lr_scheduler, model_parameters, settings,
                               engine_class=ForeignScheduleEngine, args=_without_config(args),
                               training_data=training_data, collate_fn=collate_fn,
                               dist_init_required=dist_init_required)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _ds_config(args, config):
    """The ds_config as a dict, wherever deepspeed.initialize would take it from (None: it will say so)."""
    if config is None:
        config = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    return None if config is None else load_ds_config(config)


def _without_config(args):
    """`args` without its ds_config path: the config goes in as the dict read here (deepspeed.initialize takes
    one or the other)."""
    if getattr(args, "deepspeed_config", None) is None and getattr(args, "deepscale_config", None) is None:
        return args
    cleared = copy.copy(args)
    for name in ("deepspeed_config", "deepscale_config"):
        if hasattr(cleared, name):
            setattr(cleared, name, None)
    return cleared


def _rebound(model, module, optimizer, model_parameters, lr_scheduler):
    """The optimizer and model_parameters, bound to `module` (the rebuilt chunks) where they were to `model`.

    A parameter is known by its name in the PipelineModule (DeepSpeed's: the global layer index, or
    tied_modules.KEY), which the rebuilt chunks keep. Each rank's `model` holds its own stage's layers only,
    and the chunks other layers, so the ranks exchange which names each of their groups holds: a rebuilt
    parameter joins the group that holds its name on whichever rank built it, with that group's settings
    (a parameter in no group stays out of the optimizer, as the user left it)."""
    names = {id(p): n for n, p in model.named_parameters()}
    if model_parameters is not None:
        given = list(model_parameters)
        grouped = any(isinstance(g, dict) for g in given)
        groups = _regrouped(given if grouped else [{"params": given}], names, module, "model_parameters")
        model_parameters = expert_groups(groups) if grouped or has_experts(module) else groups[0]["params"]
    elif optimizer is None or callable(optimizer):
        model_parameters = module_groups(module) if has_experts(module) else None  # DeepSpeed's default, split
    if isinstance(optimizer, torch.optim.Optimizer):
        if isinstance(lr_scheduler, torch.optim.lr_scheduler.LRScheduler):
            raise ConfigError("lr_scheduler: an lr scheduler object is bound to the optimizer, which megatron_ds."
                              "initialize rebuilds over the schedule's chunks; pass lr_scheduler=lambda optimizer: "
                              '... or the ds_config\'s "scheduler"')
        optimizer = _rebuilt(optimizer, expert_groups(_regrouped(optimizer.param_groups, names, module, "optimizer")))
    return optimizer, model_parameters


def _regrouped(groups, names, module, what):
    """`groups` (param group dicts over the user's module, whose parameter names `names` gives by id) as the
    same groups over `module`'s parameters, found by name across every rank's groups."""
    local = []
    for i, group in enumerate(groups):
        params = [group["params"]] if torch.is_tensor(group["params"]) else list(group["params"])
        unknown = [p for p in params if id(p) not in names]
        if unknown:
            raise ConfigError(f"{what}: group {i} holds {len(unknown)} tensor(s) that are not the PipelineModule's "
                              "parameters; megatron_ds.initialize builds its layers again for the schedule's chunks "
                              "and finds each parameter there by its name in the module")
        settings = {k: v for k, v in group.items() if k != "params"}
        local.append(([names[id(p)] for p in params], settings))
    everyone = [local]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, local)
    if len({len(rank) for rank in everyone}) > 1:
        raise ConfigError(f"{what}: the ranks pass {sorted({len(rank) for rank in everyone})} parameter groups; "
                          "every rank must pass the same groups (each over its own stage's parameters)")
    where, settings = {}, []
    for i in range(len(local)):
        kinds = {repr(sorted(rank[i][1].items())) for rank in everyone}
        if len(kinds) > 1:
            raise ConfigError(f"{what}: parameter group {i} has other settings on other ranks: {sorted(kinds)}")
        settings.append(local[i][1])
        for rank in everyone:
            for name in rank[i][0]:
                if where.setdefault(name, i) != i:
                    raise ConfigError(f"{what}: parameter {name!r} is in groups {where[name]} and {i}")
    rebuilt = [{**s, "params": []} for s in settings]
    for name, p in module.named_parameters():
        if name in where and p.requires_grad:
            rebuilt[where[name]]["params"].append(p)
    return rebuilt


def _rebuilt(optimizer, groups):
    """An optimizer of `optimizer`'s class and settings over `groups` (param groups with their own settings; the
    defaults that its constructor takes: AdamW's hold decoupled_weight_decay, which AdamW() does not)."""
    accepted = inspect.signature(type(optimizer)).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    return type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if takes_any or k in accepted})
