"""Build the pipelined GPT and its DeepSpeed engine from a GPTConfig and a ds_config.

No schedule in the ds_config (or "deepspeed"): DeepSpeed's PipelineModule and
stock PipelineEngine (TrainSchedule, 1F1B), unchanged - the baseline. A named
schedule: the layers cut into its virtual stages (ChunkedPipelineModule) and run
by ScheduleEngine.
"""
import functools
from contextlib import contextmanager

import deepspeed
import torch.distributed as dist
from deepspeed.pipe import PipelineModule
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

from megatron_ds.model import GPTConfig, gpt_layer_specs, gpt_loss
from megatron_ds.schedules import ScheduleError

from .config import ConfigError, pipeline_settings
from .engine import ScheduleEngine
from .module import ChunkedPipelineModule
from .shape import check_layers, segment_lengths
from .trace import traced_engine

CHECKPOINTABLE_LAYERS = ["TransformerLayer"]


def topology(pp: int):
    world = dist.get_world_size()
    if pp < 1 or world % pp:
        raise ConfigError(f"--pipeline-model-parallel-size {pp} must divide the world size {world}")
    return PipeDataParallelTopology(num_pp=pp, num_dp=world // pp)


def micro_batches_per_step(ds_config: dict, dp: int) -> tuple[int, int]:
    """(micro-batch size, gradient accumulation steps) from the ds_config's batch keys."""
    mbs = ds_config.get("train_micro_batch_size_per_gpu")
    gas = ds_config.get("gradient_accumulation_steps")
    tbs = ds_config.get("train_batch_size")
    if mbs is None and tbs and gas:
        mbs = tbs // (gas * dp)
    if gas is None and tbs and mbs:
        gas = tbs // (mbs * dp)
    if not mbs or not gas:
        raise ConfigError("ds_config needs two of train_batch_size, train_micro_batch_size_per_gpu and "
                          "gradient_accumulation_steps to run a pipeline schedule")
    return mbs, gas


def build_pipeline_module(config: GPTConfig, ds_config: dict, pp: int, activation_checkpoint_interval: int = 0,
                          seq_length: int = None, *, layers=None, loss_fn=None):
    """`layers`/`loss_fn` replace the GPT's layer specs and loss (e.g. benchmarking layers);
    config.num_layers and hidden_size still give their count and the activation shape."""
    settings = pipeline_settings(ds_config)
    common = dict(layers=gpt_layer_specs(config) if layers is None else layers, loss_fn=loss_fn or gpt_loss,
                  topology=topology(pp),
                  partition_method=settings.partition_method,
                  activation_checkpoint_interval=activation_checkpoint_interval,
                  checkpointable_layers=CHECKPOINTABLE_LAYERS)
    if settings.stock:
        return PipelineModule(**common)
    zero_stage = (ds_config.get("zero_optimization") or {}).get("stage", 0)
    if zero_stage != 1:
        raise ConfigError(f'schedule {settings.schedule!r} runs with ZeRO stage 1: set "zero_optimization": '
                          f'{{"stage": 1}} (it is {zero_stage})')
    mbs, gas = micro_batches_per_step(ds_config, dist.get_world_size() // pp)
    try:
        schedule = settings.build_schedule(pp, gas)
    except ScheduleError as exc:
        raise ConfigError(f'ds_config "pipeline": {exc}') from None
    check_layers(schedule, config.num_layers)
    activation_shape = (mbs, seq_length or config.max_position_embeddings, config.hidden_size)
    lengths = segment_lengths(settings, config, activation_shape[1]) if schedule.seq_splits > 1 else None
    module = ChunkedPipelineModule(placement=schedule.placement, activation_shape=activation_shape, **common)
    module.segment_lengths = lengths  # read by ScheduleEngine to cut micro-batches into segments
    return module


@contextmanager
def _engine_class(factory):
    # deepspeed.initialize() picks PipelineEngine by name from its module globals.
    original = deepspeed.PipelineEngine
    deepspeed.PipelineEngine = factory
    try:
        yield
    finally:
        deepspeed.PipelineEngine = original


def initialize_engine(module, ds_config: dict, optimizer=None, lr_scheduler=None, model_parameters=None):
    kwargs = dict(model=module, config=ds_config, optimizer=optimizer, lr_scheduler=lr_scheduler,
                  model_parameters=model_parameters)
    if isinstance(module, ChunkedPipelineModule):
        with _engine_class(functools.partial(ScheduleEngine, settings=pipeline_settings(ds_config))):
            engine, _, _, _ = deepspeed.initialize(**kwargs)
    elif pipeline_settings(ds_config).trace_dir:  # the stock engine, traced
        with _engine_class(traced_engine(PipelineEngine)):
            engine, _, _, _ = deepspeed.initialize(**kwargs)
    else:
        engine, _, _, _ = deepspeed.initialize(**kwargs)
    return engine
