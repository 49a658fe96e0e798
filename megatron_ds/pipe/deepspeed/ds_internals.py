"""The private members of DeepSpeed's pipeline classes this package touches, in one audited place.

ZeRO's privates have theirs (zero_internals.py). Here: DeepSpeed DEEPSPEED_VERSION's PipelineModule
(runtime/pipe/module.py), PipelineEngine and its DeepSpeedEngine base (runtime/pipe/engine.py, runtime/engine.py),
the grid's ProcessTopology (runtime/pipe/topology.py), the bf16 optimizer's fp32 gradient on a parameter and the
expert-parallel group registry (utils/groups.py). Two kinds of use:
- the template methods our subclasses override (OVERRIDDEN: each with the signature it is written against),
  which DeepSpeed calls and which may call DeepSpeed's own through super();
- every other private read, written or called: a function below, so that the rest of the package names none.
Members with public names that DeepSpeed keeps as undocumented state (`parts`, `forward_funcs`, ...) are listed in
STATE. tests/pipe/deepspeed/test_ds_internals.py checks all of it against the installed DeepSpeed, and that no module
outside this one and zero_internals.py names a listed private.
"""
import contextlib

DEEPSPEED_VERSION = "0.19.8"

ENGINE = "deepspeed.runtime.pipe.engine.PipelineEngine"
MODULE = "deepspeed.runtime.pipe.module.PipelineModule"
TOPOLOGY = "deepspeed.runtime.pipe.topology.PipelineParallelGrid"
GROUPS = "deepspeed.utils.groups"

# {class: {template method: its signature as our override is written against it}}: DeepSpeed calls them.
# _INSTRUCTION_MAP (a class attribute) maps each PipeInstruction class to a handler taking the engine and the
# instruction's keyword arguments; ours extend DeepSpeed's (pipe/engine.py, sequence_parallel.py, trace.py).
OVERRIDDEN = {
    ENGINE: {
        "_exec_schedule": "(self, pipe_schedule)",  # engine.py, trace.py, moe.py
        "_train_schedule": "(self)",
        "_inference_schedule": "(self, micro_batches)",
        "_take_model_step": "(self, lr_kwargs)",  # engine.py (post-validation), moe.py
        "_aggregate_total_loss": "(self)",
        "_configure_distributed_model": "(self, model)",  # moe.py
    },
    MODULE: {
        "_partition_layers": "(self, method='uniform')",  # module.py
        "_build": "(self)",
        "_precompute_checkpointable_values": "(self)",
    },
}
CLASS_ATTRIBUTES = {ENGINE: ("_INSTRUCTION_MAP",)}

# {class: {private method called through a function below: its signature}}
CALLED = {
    ENGINE: {
        "_reduce_outputs": "(self, outputs, reduce='avg', reduce_dp=True, micro_batches=None)",
        "_reentrant_activation_checkpointing": "(self)",
        "_get_zero_param_shapes": "(self)",  # replaced for a save (moe_checkpoint.py)
        "_copy_recovery_script": "(self, save_path)",  # replaced (training/checkpoint/recovery_script.py)
    },
    MODULE: {
        "_set_bounds": "(self, start=None, stop=None)",
        "_count_layer_params": "(self)",
        "_find_layer_type": "(self, layername)",
        "_synchronize_tied_weights": "(self)",  # put off during a chunked load (module.py)
    },
}
# {class: private instance attributes read or written through a function below}
ATTRIBUTES = {
    ENGINE: ("_running_engine_backward", "_exec_instr"),
    MODULE: ("_layer_specs", "_grid", "_local_start", "_local_stop"),
    TOPOLOGY: ("_topo",),
}
PARAM_ATTRIBUTES = ("_hp_grad",)  # set on each bf16 parameter by DeepSpeed's BF16_Optimizer
GROUP_REGISTRIES = ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
                    "_EXPERT_DATA_PARALLEL_GROUP_RANKS")
GROUP_FUNCTIONS = ("_get_expert_parallel_group_dict", "_get_expert_parallel_group")
# {class: public-named attributes DeepSpeed keeps as its own state, which chunked modules read or set directly}
STATE = {
    MODULE: ("parts", "forward_funcs", "num_stages", "stage_id", "is_checkpointable_results",
             "is_checkpointable_results_interval", "activation_checkpoint_interval"),
}


# -- PipelineModule ------------------------------------------------------------------------------------------------
def layer_specs(module) -> list:
    """The module's whole layer list (LayerSpecs, TiedLayerSpecs, modules, callables), on every rank."""
    return module._layer_specs


def grid(module):
    """The module's PipelineParallelGrid."""
    return module._grid


def topology_of(grid):
    """A PipelineParallelGrid's ProcessTopology (module.topology() is the module's own, the same object)."""
    return grid._topo


def local_start(module) -> int:
    """The global index of the first layer the module's forward runs now (a chunked module's active chunk)."""
    return module._local_start


def local_stop(module) -> int:
    return module._local_stop


def set_bounds(module, start: int, stop: int):
    """The global layers [start, stop) as the module's own: those _build builds, and the indices its layer
    files are named by (DeepSpeed's _set_bounds; a chunked module sets each chunk's as it makes it active)."""
    module._set_bounds(start=start, stop=stop)


def layer_parameter_counts(module) -> list:
    """The trainable parameters of each layer spec (DeepSpeed's "parameters" partition weights)."""
    return module._count_layer_params()


def layers_of_type(module, regex: str) -> list:
    """The indices of the layer specs whose class name matches `regex` (DeepSpeed's "type:" partition)."""
    return module._find_layer_type(regex)


@contextlib.contextmanager
def tied_weight_sync_put_off(module):
    """Within it the module's tied-weight broadcast does nothing; it runs once on the way out (each chunk's
    load_state_dir would run that collective otherwise)."""
    module._synchronize_tied_weights = lambda: None
    try:
        yield
    finally:
        del module._synchronize_tied_weights
    module._synchronize_tied_weights()


# -- PipelineEngine ------------------------------------------------------------------------------------------------
def instruction_map(engine_class) -> dict:
    """The instruction handlers of a PipelineEngine class ({PipeInstruction class: handler(engine, **kwargs)})."""
    return engine_class._INSTRUCTION_MAP


@contextlib.contextmanager
def engine_backward(engine):
    """Gradients computed within it count as the engine's: DeepSpeed's post-backward hooks check the flag."""
    engine._running_engine_backward = True
    try:
        yield
    finally:
        engine._running_engine_backward = False


def running_instruction(engine):
    """The name of the handler of the instruction DeepSpeed's _exec_schedule runs now (None before the first)."""
    return getattr(getattr(engine, "_exec_instr", None), "__name__", None)


def reentrant_activation_checkpointing(engine) -> bool:
    """Whether the first stage's inputs must ask for gradients (DeepSpeed's reentrant activation checkpoints)."""
    return engine._reentrant_activation_checkpointing()


def reduce_outputs(engine, outputs, reduce, micro_batches):
    """DeepSpeed's eval_batch reduction of the micro-batches' outputs (`reduce`: "avg" or None)."""
    return engine._reduce_outputs(outputs, reduce=reduce, micro_batches=micro_batches)


@contextlib.contextmanager
def zero_param_shapes_as(engine, change):
    """Within it the model states' list of ZeRO parameter shapes is change(DeepSpeed's list)."""
    shapes = engine._get_zero_param_shapes
    engine._get_zero_param_shapes = lambda: change(shapes())
    try:
        yield
    finally:
        del engine._get_zero_param_shapes


def replace_recovery_script(engine, copy):
    """copy(save_path) in place of DeepSpeed's copy of its recovery script into a save."""
    engine._copy_recovery_script = copy


# -- parameters and groups -----------------------------------------------------------------------------------------
def fp32_grad(param):
    """The fp32 gradient DeepSpeed's bf16 optimizer keeps for `param` (None when it holds none)."""
    return getattr(param, "_hp_grad", None)


def expert_parallel_registries():
    """DeepSpeed's registries of expert-parallel groups, {name: group} and {name: ranks}, then the
    expert-data-parallel ones: (EP groups, EP ranks, EDP groups, EDP ranks)."""
    from deepspeed.utils import groups  # lazy: DeepSpeed's group registry, for expert-parallel runs only
    return tuple(getattr(groups, name) for name in GROUP_REGISTRIES)


def expert_parallel_group(name):
    """The registered EP group `name`, None when there is none."""
    from deepspeed.utils import groups  # lazy: DeepSpeed's group registry, for expert-parallel runs only
    return groups._get_expert_parallel_group(name) if name in groups._get_expert_parallel_group_dict() else None
