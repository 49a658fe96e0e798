"""The checkpoint of an expert-parallel run is the checkpoint of the same model without expert parallelism.

A MoE layer's file (DeepSpeed's `layer_XX-model_states.pt`) holds every expert under its global index
(`mlp.experts.<E>.…`), as a run with EP 1 writes it, so nothing saved depends on the EP size: a run under
another EP size, the offline readers (convert/ds_format.py, the Hugging Face export) and the universal
converter read it unchanged. A save gathers the other EP ranks' experts to the rank that writes the layer's
file (data-parallel replica 0 of its stage and TP rank); a load keeps this rank's experts of the file
(model/moe.MoE drops the others). The ZeRO-1 shards name each expert's optimizer state by its global name,
cut over its expert-data-parallel group: a resume under the same layout loads them as DeepSpeed saved them,
one under another EP size re-cuts them by name (training/checkpoint/relayout.py), as for any other layout change.

DeepSpeed's own MoE checkpoint (taken when `has_moe_layers` is set: expert files by EP rank, `expp_rank_`
optimizer files, expert shapes missing from the model states) is kept out: around a save and a load the
engine is one without MoE layers to DeepSpeed (`dense_checkpoint`).
"""
import collections
import contextlib
import functools
import re

import torch
import torch.distributed as dist

from megatron_ds.model.moe import MoE, expert_of

from ..deepspeed import ds_internals as ds
from ..plan.config import ConfigError

PREFIX = "experts."
_EXPERT_NAME = re.compile(r"^(.*\.experts\.)\d+(\..*)$")  # a parameter name: (up to the index, after it)


def expert_parallel_layers(module):
    return [m for m in module.modules() if isinstance(m, MoE) and m.ep_group is not None]


def check_layer_writes(module):
    """DeepSpeed's parallel layer write (ds_config "checkpoint": {"parallel_write": {"pipeline_stage": true}})
    spreads a stage's layer files over its data-parallel ranks; the experts are gathered to replica 0."""
    if expert_parallel_layers(module) and getattr(module, "checkpoint_parallel_write_pipeline", False):
        raise ConfigError("ds_config \"checkpoint\": {\"parallel_write\": {\"pipeline_stage\": true}} with "
                          "--expert-model-parallel-size > 1: the layer files of an expert-parallel run are written "
                          "by data-parallel replica 0 of each stage, which gathers the experts; remove the key")


def layer_file_writer(grid) -> int:
    """The global rank that writes this rank's layer files: the same stage and TP rank, data-parallel replica 0
    (DeepSpeed's PipelineModule.save_state_dict)."""
    topo = ds.topology_of(grid)
    return topo.get_rank(**{**topo.get_coord(dist.get_rank())._asdict(), "data": 0})


def _gathered_experts(layer, writer):
    """{state key under the layer: tensor on the CPU} of the experts the other ranks of `layer`'s EP group hold,
    on `writer`; {} elsewhere. One flat tensor per rank travels (experts are alike in shape)."""
    local = layer.experts.state_dict()
    flat = torch.cat([t.detach().reshape(-1) for t in local.values()])
    mine = dist.get_rank() == writer
    parts = [torch.empty_like(flat) for _ in range(dist.get_world_size(layer.ep_group))] if mine else None
    dist.gather(flat, parts, dst=writer, group=layer.ep_group)
    if not mine:
        return {}
    per_rank, first = len(layer.local_experts), layer.local_experts[0]
    others = {}
    for rank, part in enumerate(parts):
        offset = 0
        for key, t in local.items():  # "<E>.<name>" for this rank's experts, in their order
            index, name = key.split(".", 1)
            expert = rank * per_rank + int(index) - first
            if expert not in layer.local_experts:
                others[f"{PREFIX}{expert}.{name}"] = part[offset:offset + t.numel()].view(t.shape).cpu()
            offset += t.numel()
    return others


def _every_expert(others, module, state, prefix, meta):
    """A state-dict post hook: this layer's experts, the local ones and `others`, in global index order where
    the local ones were."""
    items = list(state.items())
    experts = {k: v for k, v in items if expert_of(k, prefix) is not None}
    experts.update({prefix + k: v for k, v in others.items()})
    ordered = sorted(experts.items(), key=lambda kv: expert_of(kv[0], prefix))
    state.clear()
    for key, value in items:
        if key not in experts:
            state[key] = value
        elif ordered:
            state.update(ordered)
            ordered = []


def with_every_expert(group_shapes, num_experts):
    """DeepSpeed's PARAM_SHAPES ([{name: shape}] per optimizer group, in the model states that replica 0
    writes) with the experts the other EP ranks hold added to their group: DeepSpeed's universal converter
    merges the parameters these name (their fragments are in every rank's ZeRO shards). Their order matters
    only to DeepSpeed's zero_to_fp32.py, which training/checkpoint/recovery_script.py replaces."""
    out = []
    for shapes in group_shapes:
        shapes = collections.OrderedDict(shapes)
        for name, shape in list(shapes.items()):
            m = _EXPERT_NAME.match(name)
            for e in range(num_experts) if m else ():
                shapes.setdefault(f"{m[1]}{e}{m[2]}", shape)
        out.append(shapes)
    return out


@contextlib.contextmanager
def whole_experts(engine):
    """Within it, the MoE layers' state dicts on the layer files' writers hold every expert (a collective of
    each EP group that holds a writer), and so does the model states' list of parameter shapes."""
    layers = expert_parallel_layers(engine.module)
    if not layers:
        yield
        return
    num_experts = layers[0].config.num_experts
    with ds.zero_param_shapes_as(engine, lambda shapes: with_every_expert(shapes, num_experts)):
        writer = layer_file_writer(engine.grid)
        handles = []
        for layer in layers:
            if writer not in dist.get_process_group_ranks(layer.ep_group):
                continue  # no rank of this EP group writes layer files
            others = _gathered_experts(layer, writer)
            if others:
                handles.append(layer.register_state_dict_post_hook(functools.partial(_every_expert, others)))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


@contextlib.contextmanager
def dense_checkpoint(engine):
    """DeepSpeed saves and loads the engine as it does a model without MoE layers."""
    has_moe, engine.has_moe_layers = engine.has_moe_layers, False
    try:
        yield
    finally:
        engine.has_moe_layers = has_moe
