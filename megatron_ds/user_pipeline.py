"""megatron_ds.initialize: deepspeed.initialize, with our schedules for a user's own PipelineModule.

Same arguments and return values as deepspeed.initialize. A PipelineModule and a ds_config whose
"pipeline.schedule" names a schedule get our engine (pipe/foreign_engine.py) over the module's layers cut into
the schedule's chunks (pipe/foreign.py); anything else goes to deepspeed.initialize untouched, DeepSpeed's
own engine included. The module is built again for the chunks, so what was bound to its parameters is
bound again to the new ones: `model_parameters` (the module's parameters), an optimizer object (one param
group, rebuilt with its defaults); an lr scheduler object, bound to the old optimizer, cannot be, so a
scheduler comes as a callable or from the ds_config.
"""
import copy
import inspect

import deepspeed
import torch
from deepspeed.constants import TORCH_DISTRIBUTED_DEFAULT_PORT
from deepspeed.pipe import PipelineModule
from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config

from megatron_ds.pipe.build import initialize_engine
from megatron_ds.pipe.config import ConfigError, pipeline_settings
from megatron_ds.pipe.foreign import check_settings, chunked, partition_method, plan_for
from megatron_ds.pipe.foreign_engine import ForeignScheduleEngine


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
    if settings.stock:
        return deepspeed.initialize(**given)
    if not isinstance(model, PipelineModule):
        raise ConfigError(f'ds_config "pipeline.schedule" = {settings.schedule!r} runs a deepspeed.pipe.PipelineModule; '
                          f"the model is a {type(model).__name__}")
    check_settings(settings, ds_config)
    plan = plan_for(model, ds_config, settings)
    module = chunked(model, plan, partition_method(model, ds_config, plan.schedule.stages))
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
    """The optimizer and model_parameters, bound to `module` (the rebuilt chunks) where they were to `model`."""
    mine = {id(p) for p in model.parameters()}
    new = [p for p in module.parameters() if p.requires_grad]
    if model_parameters is not None:
        given = list(model_parameters)
        if any(isinstance(g, dict) for g in given) or not all(id(p) in mine for p in given):
            raise ConfigError("model_parameters: megatron_ds.initialize builds the PipelineModule's layers again for "
                              "the schedule's chunks, and takes the module's own parameters (model.parameters()) "
                              "only; for parameter groups pass optimizer=lambda params: ... or the ds_config's "
                              '"optimizer"')
        model_parameters = new
    if isinstance(optimizer, torch.optim.Optimizer):
        if len(optimizer.param_groups) != 1 or not all(id(p) in mine for p in optimizer.param_groups[0]["params"]):
            raise ConfigError("optimizer: megatron_ds.initialize builds the PipelineModule's layers again for the "
                              "schedule's chunks and rebuilds an optimizer of one param group over them; pass "
                              "optimizer=lambda params: ... for parameter groups")
        if isinstance(lr_scheduler, torch.optim.lr_scheduler.LRScheduler):
            raise ConfigError("lr_scheduler: an lr scheduler object is bound to the optimizer, which megatron_ds."
                              "initialize rebuilds over the schedule's chunks; pass lr_scheduler=lambda optimizer: "
                              '... or the ds_config\'s "scheduler"')
        optimizer = _rebuilt(optimizer, new)
    return optimizer, model_parameters


def _rebuilt(optimizer, params):
    """An optimizer of `optimizer`'s class and settings over `params` (its defaults that its constructor takes:
    AdamW's hold decoupled_weight_decay, which AdamW() does not)."""
    accepted = inspect.signature(type(optimizer)).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    return type(optimizer)(params, **{k: v for k, v in optimizer.defaults.items() if takes_any or k in accepted})
