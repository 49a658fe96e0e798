"""Build the pipelined GPT and its DeepSpeed engine from a GPTConfig and a ds_config.

No schedule in the ds_config (or "deepspeed"): DeepSpeed's PipelineModule and
stock PipelineEngine (TrainSchedule, 1F1B), unchanged - the baseline.
"""
import deepspeed
import torch.distributed as dist
from deepspeed.pipe import PipelineModule
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

from megatron_ds.model import GPTConfig, gpt_layer_specs, gpt_loss

from .config import ConfigError, pipeline_settings

CHECKPOINTABLE_LAYERS = ["TransformerLayer"]


def topology(pp: int):
    world = dist.get_world_size()
    if pp < 1 or world % pp:
        raise ConfigError(f"--pipeline-model-parallel-size {pp} must divide the world size {world}")
    return PipeDataParallelTopology(num_pp=pp, num_dp=world // pp)


def build_pipeline_module(config: GPTConfig, ds_config: dict, pp: int, activation_checkpoint_interval: int = 0):
    settings = pipeline_settings(ds_config)
    if not settings.stock:
        raise ConfigError(f'schedule {settings.schedule!r} needs the megatron_ds engine, which this build lacks')
    return PipelineModule(layers=gpt_layer_specs(config), loss_fn=gpt_loss, topology=topology(pp),
                          partition_method=settings.partition_method,
                          activation_checkpoint_interval=activation_checkpoint_interval,
                          checkpointable_layers=CHECKPOINTABLE_LAYERS)


def initialize_engine(module, ds_config: dict, optimizer=None, lr_scheduler=None, model_parameters=None):
    engine, _, _, _ = deepspeed.initialize(model=module, config=ds_config, optimizer=optimizer,
                                           lr_scheduler=lr_scheduler, model_parameters=model_parameters)
    return engine
