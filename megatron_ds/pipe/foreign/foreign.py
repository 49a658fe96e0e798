"""A user's own DeepSpeed PipelineModule cut into a schedule's virtual stages (megatron_ds.initialize).

DeepSpeed's PipelineModule builds, when constructed, one stage's layers per rank; a schedule with several
chunks per rank (interleaved, the V shapes, BitPipe's twins) needs other layers there. The module keeps its
whole layer list (modules, LayerSpecs, TiedLayerSpecs, functions) and its settings, so it is built again
from them as a ChunkedPipelineModule, the GPT's: the same layers, loss, topology, seeds and activation
checkpointing, cut by the same partition method into the schedule's stages. DeepSpeed keeps no record of
the method, only the bounds it cut, so the method is the one that cuts those bounds again (or the ds_config's
"pipeline.partition_method").

What a foreign layer cannot do is refused here, in one line naming what a layer would have to provide.
"""
import dataclasses

import torch
import torch.distributed as dist
from deepspeed.runtime import utils as ds_utils
from deepspeed.runtime.pipe.module import LayerSpec

from megatron_ds.schedules import ScheduleError

from ..deepspeed import ds_internals as ds
from ..plan.config import ConfigError
from ..module import ChunkedPipelineModule
from ..plan.plan import PipelinePlan, micro_batches_per_step, too_few_layers

DEEPSPEED_METHODS = "DeepSpeed's partition methods (\"parameters\", \"uniform\", \"type:REGEX\")"


def check_settings(settings, ds_config, segments=False, auto=False):
    """The "pipeline" settings a user's own layers cannot run, refused with what a layer would need; `segments`:
    its layers take Seq1F1B's segments (pipe/hf/: the K/V cache in their attention); `auto`: its sizes are known
    (pipe/hf/: the model's config), so "auto" can weigh its candidates."""
    where = 'ds_config "pipeline"'
    if settings.auto and not auto:
        raise ConfigError(f'{where}."schedule" = "auto" with your own PipelineModule: "auto" builds its candidates '
                          "from the GPT's sizes (layers, hidden size, sequence, vocabulary), which a PipelineModule's "
                          "layers do not state; name a schedule")
    if settings.seq_splits > 1 and not segments:
        raise ConfigError(f'{where}."seq_splits" = {settings.seq_splits} with your own PipelineModule: Seq1F1B runs '
                          "each micro-batch as sequence segments, and a layer must know which tokens it holds and "
                          "keep the keys/values of earlier segments (megatron_ds.model's attention and its "
                          "SegmentKVCache); choose a schedule without segments")
    if settings.vocab_parallel:
        raise ConfigError(f'{where}."vocab_parallel" = true with your own PipelineModule: the vocabulary passes '
                          "slice the word embedding and the output layer + loss, which must be megatron_ds.model's "
                          "(model/vocab_slices.py); leave it out")
    method = settings.partition_method
    if "partition_method" in (ds_config.get("pipeline") or {}) and not _deepspeed_method(method):
        raise ConfigError(f'{where}."partition_method" = {method!r} with your own PipelineModule: the cost and '
                          f"layout methods weigh the GPT's layers; use one of {DEEPSPEED_METHODS}")
    seed_layers = (ds_config.get("pipeline") or {}).get("seed_layers", False)
    if not isinstance(seed_layers, bool):
        raise ConfigError(f'{where}."seed_layers" = {seed_layers!r}: must be true or false')
    zero = (ds_config.get("zero_optimization") or {}).get("stage", 0)
    if zero not in (0, 1) or (settings.post_validation and zero != 1):
        raise ConfigError(f'{where}: schedule {settings.schedule!r} runs with ZeRO stage 0 or 1 (post_validation: '
                          f'1); "zero_optimization.stage" is {zero}')


def _deepspeed_method(method):
    return method in ("uniform", "parameters") or method.startswith("type:")


def plan_for(module, ds_config, settings, segments=None, cp=1):
    """The PipelinePlan of `module` (a PipelineModule as its user built it) under the settings' schedule;
    `segments`: (sequence length, hidden size, the Seq1F1B segments' lengths) of layers that take segments;
    `cp`: the context-parallel ranks of each replica, inner on the topology's data axis (DP x CP)."""
    topology = module.topology()
    if "model" in topology.get_axis_names() and topology.get_dim("model") > 1:
        raise ConfigError("a schedule with your own PipelineModule runs pipeline x data parallelism; its "
                          "topology has a tensor-parallel axis (\"model\") of size "
                          f"{topology.get_dim('model')}, which megatron_ds.initialize does not run yet")
    pp, dp = topology.get_dim("pipe"), topology.get_dim("data")
    if dp % cp:
        raise ConfigError(f'ds_config "context_parallel.context_parallel_size" = {cp} must divide the topology\'s '
                          f"data axis ({dp} ranks = data-parallel x context-parallel)")
    dp //= cp  # the batch counts samples, as without CP
    mbs, gas = micro_batches_per_step(_deepspeed_batch(ds_config), dp)
    seq_length, hidden_size, lengths = segments or (0, 0, None)
    try:
        schedule = settings.build_schedule(pp, gas, lengths)
    except ScheduleError as exc:
        raise ConfigError(f'ds_config "pipeline": {exc}') from None
    if schedule.seq_splits > 1 or schedule.vocab_parallel:  # a schedule file may carry them
        check_settings(dataclasses.replace(settings, seq_splits=schedule.seq_splits,
                                           vocab_parallel=schedule.vocab_parallel), ds_config, segments is not None)
    layers = len(ds.layer_specs(module))
    if layers < schedule.stages:
        raise ConfigError(too_few_layers(schedule, f"your PipelineModule's {layers} layers", layers,
                                         layer="layer"))
    # seq_length and hidden_size give the GPT's message shape; these messages learn theirs (pipe/foreign/learned_p2p.py)
    return PipelinePlan(settings, pp, mbs, gas, seq_length=seq_length, hidden_size=hidden_size,
                        segment_lengths=lengths)


def _deepspeed_batch(ds_config):
    """DeepSpeed's reading of a ds_config that gives one batch key: train_batch_size alone, or the micro-batch size
    alone, is one micro-batch a step (gradient_accumulation_steps 1)."""
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    if [k for k in keys if ds_config.get(k)] in (["train_batch_size"], ["train_micro_batch_size_per_gpu"]):
        return {**ds_config, "gradient_accumulation_steps": 1}
    return ds_config


def partition_method(module, ds_config, stages):
    """The ds_config's "pipeline.partition_method", else the DeepSpeed method that cuts `module` as it is cut
    (the first of "parameters", DeepSpeed's default, "uniform", "type:CLASS" that does; the log says so when
    another one would cut the `stages` virtual stages otherwise)."""
    section = ds_config.get("pipeline") or {}
    if "partition_method" in section:
        return section["partition_method"]
    names = []
    for layer in ds.layer_specs(module):
        if isinstance(layer, (LayerSpec, torch.nn.Module)):
            name = layer.typename.__name__ if isinstance(layer, LayerSpec) else type(layer).__name__
            names += [name] if name not in names else []
    parts, found = [int(b) for b in module.parts], []
    for method in ["parameters", "uniform", *(f"type:{name}" for name in names)]:
        try:
            if _cut(module, method, module.num_stages) == parts:
                found.append(method)
        except RuntimeError:  # a type that matches nothing
            continue
    if found:
        if len({tuple(_cut(module, m, stages)) for m in found}) > 1 and dist.get_rank() == 0:
            print(f"megatron_ds: the PipelineModule's stages {parts} are the cut of {found}; its layers are cut into "
                  f'the schedule\'s stages by {found[0]!r} (set "pipeline.partition_method" for another)', flush=True)
        return found[0]
    raise ConfigError(f"your PipelineModule's stages {parts} are not a cut of any of {DEEPSPEED_METHODS} over its "
                      'layers; name the method in the ds_config\'s "pipeline.partition_method"')


def _cut(module, method, stages):
    """DeepSpeed's partition of `module`'s layers into `stages` by `method` (its PipelineModule's partition,
    without the log)."""
    if method == "uniform":
        parts = ds_utils.partition_uniform(num_items=len(ds.layer_specs(module)), num_parts=stages)
    elif method == "parameters":
        parts = ds_utils.partition_balanced(weights=ds.layer_parameter_counts(module), num_parts=stages)
    else:
        weights = [0] * len(ds.layer_specs(module))
        for idx in ds.layers_of_type(module, method.split(":", 1)[1]):
            weights[idx] = 1
        parts = ds_utils.partition_balanced(weights=weights, num_parts=stages)
    return [int(b) for b in parts]


def check_parameters(module, plan, method):
    """Every pipeline rank's stages hold a trainable parameter: DeepSpeed builds each rank's optimizer over its
    own, and stops a rank that has none ("optimizer got an empty parameter list") while the others wait. One
    ConfigError, the same on every rank (from the layer specs, no collective), names the rank and its stages."""
    counts = ds.layer_parameter_counts(module)
    parts = _cut(module, method, plan.schedule.stages)
    for rank in range(plan.schedule.pp):
        stages = sorted({stage for _, stage in plan.schedule.chunks_on(rank)})
        if all(sum(counts[parts[s]:parts[s + 1]]) == 0 for s in stages):
            layers = ", ".join(f"{parts[s]}-{parts[s + 1] - 1}" for s in stages)
            raise ConfigError(f"schedule {plan.settings.schedule!r}: pipeline rank {rank} holds stage(s) {stages} "
                              f"(layers {layers} of partition_method {method!r}, bounds {parts}), which have no "
                              "trainable parameters, and DeepSpeed's optimizer needs some on every rank; give those "
                              'layers parameters or cut the layers otherwise ("pipeline.partition_method")')


def seed_layer(seed):
    """DeepSpeed's per-layer seed (`PipelineModule(seed_layers=True, seed_fn=megatron_ds.seed_layer)`), taken as an
    int: DeepSpeed 0.19.8 adds the layer index to its partition's bounds, numpy ints under its default
    "parameters" method, and its set_random_seed hands that to Python's random.seed, which refuses any type but
    None, int, float, str and bytes (a TypeError while the module is built, under either engine)."""
    ds_utils.set_random_seed(int(seed))


def chunked(module, plan, method, seed_layers=False):
    """`module`'s layers built again as the chunks `plan` places on this rank. `seed_layers` (ds_config
    "pipeline.seed_layers", DeepSpeed's key) seeds each layer as the module's own seed_layers does: with base_seed +
    its global index, so each layer starts from the same weights however the schedule cuts the layers."""
    seeding = bool(module.seed_layers or seed_layers)
    chunked_module = ChunkedPipelineModule(
        layers=ds.layer_specs(module), plan=plan, loss_fn=module.loss_fn, topology=module.topology(),
        seed_layers=seeding, seed_fn=module.seed_fn or (seed_layer if seeding else None), base_seed=module.base_seed,
        partition_method=method, activation_checkpoint_interval=module.activation_checkpoint_interval,
        activation_checkpoint_func=module.activation_checkpoint_func,
        checkpointable_layers=module.checkpointable_layers, dynamic_shape=module.dynamic_shape)
    chunked_module.packing = None  # no packed documents: the engine reads none
    return chunked_module
