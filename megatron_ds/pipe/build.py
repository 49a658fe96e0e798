"""Build the pipelined GPT and its DeepSpeed engine from a GPTConfig and a ds_config.

No schedule in the ds_config (or "deepspeed"): DeepSpeed's PipelineModule and
stock PipelineEngine (TrainSchedule, 1F1B), unchanged - the baseline. A named
schedule: the layers cut into its virtual stages (ChunkedPipelineModule) and run
by ScheduleEngine.
"""
import functools
from contextlib import contextmanager

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.pipe import PipelineModule
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology, PipeModelDataParallelTopology

from megatron_ds.model import GPTConfig, gpt_layer_specs
from megatron_ds.model.compile import compile_layers
from megatron_ds.model.documents import Packing
from megatron_ds.model.layers import FinalNorm, TransformerLayer, compiled_loss, loss_function
from megatron_ds.model.tensor_parallel import ensure_model_parallel
from megatron_ds.model.vocab_slices import VocabSlice, vocab_layer_specs
from megatron_ds.parallel_layout import data_parallel_size

from .plan.config import ConfigError, pipeline_settings, sequence_parallel_ds_config
from .parallel.context_parallel import (context_parallel_engine, context_parallel_size, deepspeed_batch,
                                        ensure_context_parallel)
from .engine import ScheduleEngine
from .moe.moe import ensure_expert_parallel, routers, with_router_step
from .module import ChunkedPipelineModule, CostPartitionedPipelineModule
from .plan.partition import chunk_cost_bounds, is_cost_method, stock_cost_bounds
from .plan.plan import PipelinePlan
from .plan.recompute import checked as checked_recompute, stock_problem
from .parallel.sequence_parallel import SequenceParallelPipelineEngine, on_sequence_shards, sequence_parallel_params
from .trace import TracedPipelineEngine, TracedSequenceParallelPipelineEngine, Tracer

CHECKPOINTABLE_LAYERS = ["TransformerLayer"]
STOCK_DOCUMENTS = ('--reset-attention-mask (and --reset-position-ids under RoPE) with DeepSpeed\'s own engine (no '
                   '"pipeline.schedule"): its stages past the first see hidden states only, not where documents '
                   'end; run a named schedule ("schedule": "1f1b" is its order on our engine)')


def topology(pp: int, tp: int = 1):
    """DeepSpeed's (pipe, data) topology, or with tensor parallelism (pipe, data, model): TP fastest."""
    dp = data_parallel_size(dist.get_world_size(), pp, tp)
    if tp == 1:
        return PipeDataParallelTopology(num_pp=pp, num_dp=dp)
    return PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)


def build_pipeline_module(config: GPTConfig, ds_config: dict, pp: int, activation_checkpoint_interval: int = 0,
                          seq_length: int = None, *, layers=None, loss_fn=None, settings=None, plan=None):
    """`layers`/`loss_fn` replace the GPT's layer specs and loss (e.g. benchmarking layers);
    config.num_layers and hidden_size still give their count and the activation shape. `settings` and
    `plan`: the ds_config's "pipeline" section and the PipelinePlan as made at start-up (None: made here,
    for callers without a parse, such as tests and benchmarks)."""
    settings = plan.settings if plan is not None else settings or pipeline_settings(ds_config)
    tp = getattr(config, "tensor_model_parallel_size", 1)
    if getattr(config, "sequence_parallel", False) and tp == 1:
        raise ConfigError("--sequence-parallel splits the sequence over the tensor-parallel ranks: it needs "
                          "--tensor-model-parallel-size > 1")
    if tp > 1:
        ensure_model_parallel(pp, tp)  # the layers take their TP group from it
    topo = topology(pp, tp)  # its data axis holds the context-parallel ranks too (DP x CP, CP inner)
    context = ensure_context_parallel(config, topo)  # attention takes its CP group from the registry
    ensure_expert_parallel(config, topo)  # and a MoE's layers their expert-parallel group
    recompute = checked_recompute(config)  # Megatron's recompute flags (selective: the layers' own)
    if layers is None:  # under vocabulary parallelism the word embedding and the output layer sit beside them
        layers = vocab_layer_specs(config) if settings.vocab_parallel else gpt_layer_specs(config)
    common = dict(layers=layers,
                  loss_fn=loss_fn or loss_function(config), topology=topo,
                  partition_method=settings.partition_method,
                  activation_checkpoint_interval=activation_checkpoint_interval,
                  checkpointable_layers=CHECKPOINTABLE_LAYERS)
    if settings.stock:
        if getattr(config, "documents_in_every_stage", False):
            raise ConfigError(STOCK_DOCUMENTS)
        if stock_problem(recompute):
            raise ConfigError(stock_problem(recompute))
        if recompute.full:  # uniform 1: DeepSpeed's interval 1 is Megatron's
            common["activation_checkpoint_interval"] = max(1, activation_checkpoint_interval)
        if is_cost_method(settings.partition_method):
            module = CostPartitionedPipelineModule(parts=stock_cost_bounds(config, settings, pp), **common)
        else:
            module = PipelineModule(**common)
        module.context_layout = context  # DeepSpeed's engine reads micro-batches cut to it (context_parallel.py)
        return compiled(module, settings, defer_weight_grads=False)
    packing = Packing.of(config) if getattr(config, "packs_documents", False) else None
    if plan is None:
        if settings.auto:  # the engine needs its AutoPlan, which only make_plan hands out
            raise ValueError('"schedule": "auto" without a parse: make the plan with pipe/plan/plan.make_plan, pass it '
                             "here and its AutoPlan to initialize_engine")
        dp = topo.get_dim("data") // getattr(config, "context_parallel_size", 1)
        plan = PipelinePlan.from_config(config, ds_config, pp, dp, seq_length, settings)
    parts = chunk_cost_bounds(settings.partition_method, config, plan.placement, settings.vocab_parallel)
    module = ChunkedPipelineModule(plan=plan, parts=parts, recompute=recompute, **common)
    module.packing = packing  # the engine reads each micro-batch's documents with it (model/documents.py)
    module.context_layout = context  # the engine cuts each op's tokens and labels to this rank's (or None)
    if settings.vocab_parallel:  # every pipeline rank holds a slice; the engine runs its passes (pipe/vocab/vocab_passes.py)
        module.vocab_slice = VocabSlice(config, module.stage_id, pp)
    # "auto" may switch to a schedule that splits backward: its layers leave the linears eager from the start
    return compiled(module, settings, defer_weight_grads=settings.auto or plan.splits_backward)


def compiled(module, settings, defer_weight_grads: bool):
    """The module with its transformer layers, the final norm and the loss (layers.compiled_loss) compiled
    when "pipeline.compile_layers" asks for it (the final norm runs once per op, as a layer does: eager, it
    dispatches a score of operators forward and backward, which every Seq1F1B segment pays again)."""
    if settings.compiles_layers(torch.cuda.is_available(), defer_weight_grads or settings.seq_splits > 1):
        compile_layers([m for m in module.modules() if isinstance(m, (TransformerLayer, FinalNorm))],
                       defer_weight_grads, cuda_graphs=settings.cuda_graphs)
        module.loss_fn = compiled_loss(module.loss_fn)
    return module


@contextmanager
def deepspeed_engine_class(name: str, factory):
    """deepspeed.initialize() builds the pipeline engine class it finds under `name` in its module
    globals ("PipelineEngine", "DualPipeVEngine"): make that `factory` for the calls inside."""
    original = getattr(deepspeed, name)
    setattr(deepspeed, name, factory)
    try:
        yield
    finally:
        setattr(deepspeed, name, original)


def _with_router_step(factory):
    if isinstance(factory, functools.partial):
        return functools.partial(with_router_step(factory.func), *factory.args, **factory.keywords)
    return with_router_step(factory)


def initialize_engine(module, ds_config: dict, optimizer=None, lr_scheduler=None, model_parameters=None,
                      settings=None, auto_plan=None, engine_class=ScheduleEngine, on_auto_decision=None,
                      **initialize_kwargs):
    """`auto_plan`: an "auto" run's AutoPlan (pipe/plan/plan.make_plan), which the ScheduleEngine holds, and
    `on_auto_decision` its owner's hook, called once with the AutoDecision (pipe/auto.py).
    `engine_class`: the ScheduleEngine (sub)class a chunked module gets (a user's own PipelineModule's:
    pipe/foreign/foreign_engine.py); `initialize_kwargs`: more of deepspeed.initialize's arguments (training_data...)."""
    tracer = Tracer((settings or pipeline_settings(ds_config)).trace_dir)
    sequence_parallel = bool(sequence_parallel_params(module))  # gradient shares to sum over the TP group
    if isinstance(module, ChunkedPipelineModule):  # sums sequence-parallel gradients when there are any
        factory = functools.partial(engine_class, plan=module.plan, auto_plan=auto_plan, tracer=tracer,
                                    on_auto_decision=on_auto_decision)
    else:  # the stock engine: DeepSpeed's own, or with the sequence-parallel gradient sum
        if on_sequence_shards(module):
            ds_config = sequence_parallel_ds_config(ds_config)
        traced, plain = ((TracedSequenceParallelPipelineEngine, SequenceParallelPipelineEngine) if sequence_parallel
                         else (TracedPipelineEngine, PipelineEngine))
        if context_parallel_size(module) > 1:  # its micro-batches cut to this rank's tokens
            traced, plain = context_parallel_engine(traced), context_parallel_engine(plain)
        factory = functools.partial(traced, tracer=tracer) if tracer.trace_dir else plain
    if routers(module):  # a mixture of experts: the router losses' scale, the expert bias update
        factory = _with_router_step(factory)
    ds_config = deepspeed_batch(ds_config, context_parallel_size(module))
    kwargs = dict(model=module, config=ds_config, optimizer=optimizer, lr_scheduler=lr_scheduler,
                  model_parameters=model_parameters, **initialize_kwargs)
    with deepspeed_engine_class("PipelineEngine", factory):
        engine, _, _, _ = deepspeed.initialize(**kwargs)
    return engine
