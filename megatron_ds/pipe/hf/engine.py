"""The engine of a run whose model is a Hugging Face folder (pretrain_gpt.py --hf-model): the model cut into a
PipelineModule (cut.py), then the path megatron_ds.initialize takes for a user's own module (pipe/foreign.py: the
schedule's chunks, ForeignScheduleEngine), or DeepSpeed's own engine when the ds_config names no schedule. The
optimizer and lr schedule are built by the caller over the module the engine runs (the training layer's)."""
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

from ..build import initialize_engine
from ..foreign import check_settings, chunked, plan_for
from ..foreign_engine import ForeignScheduleEngine
from .cut import PARTITION, load, pipeline_module


def build_engine(folder, ds_config, settings, pp, dp, make_optimizer, make_lr_scheduler,
                 activation_checkpoint_interval=0):
    """(engine, the transformers model it trains): `make_optimizer(module)`, `make_lr_scheduler(optimizer)`."""
    model = load(folder)
    method = (ds_config.get("pipeline") or {}).get("partition_method", PARTITION)
    module = pipeline_module(model, topology=PipeDataParallelTopology(num_pp=pp, num_dp=dp),
                             partition_method=method, activation_checkpoint_interval=activation_checkpoint_interval)
    engine_class = None
    if not settings.stock:
        check_settings(settings, ds_config)
        module = chunked(module, plan_for(module, ds_config, settings), method)
        engine_class = ForeignScheduleEngine
    optimizer = make_optimizer(module)
    lr_scheduler = make_lr_scheduler(optimizer)
    engine = initialize_engine(module, ds_config, optimizer, lr_scheduler, settings=settings,
                               **({"engine_class": engine_class} if engine_class else {}))
    return engine, model
