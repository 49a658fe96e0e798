"""The run's pipeline plan, made at parse time: the named schedule's rules on the flags (ZeRO stage,
micro-batches, layers per virtual stage, Seq1F1B segments) checked with the same code the model build runs,
a fraction of a second in, not 30 s; and the plan again for the schedule "auto" chose."""
import dataclasses

from megatron_ds.pipe.plan.config import ConfigError, pipeline_settings
from megatron_ds.pipe.plan.partition import chunk_cost_bounds, is_cost_method, stock_cost_bounds
from megatron_ds.pipe.plan.plan import make_plan

from ..errors import ArgumentsError
from .document_args import document_keys


def planned(args) -> dict:
    """{pipeline_plan, auto_plan (an "auto" run's, else None)}: pipe/plan/plan.make_plan from the flags and the
    "pipeline" section (at parse time, and for the schedule "auto" chose), and under "auto_recompute" the
    recompute setting its start takes (recomputed()); under a document mask Seq1F1B's balanced cut weighs
    the corpus's documents (document_args.document_keys)."""
    plan, auto = make_plan(args.gpt_config, args.ds_config, args.pipeline_model_parallel_size,
                           args.data_parallel_size, args.seq_length, args.pipeline_settings, document_keys(args))
    values = {"pipeline_plan": plan, "auto_plan": auto}
    if auto is not None and auto.recompute is not None:
        values.update(recomputed(args, auto.recompute))
    return values


def recomputed(args, recompute: dict) -> dict:
    """{gpt_config, checkpoint_activations} under the recompute setting "auto" chose
    (schedules/auto_recompute.as_dict's form)."""
    config = dataclasses.replace(args.gpt_config, recompute_granularity=recompute["granularity"],
                                 recompute_method=recompute["method"], recompute_num_layers=recompute["num_layers"])
    # the MFU's FLOPs count the recomputation
    return {"gpt_config": config, "checkpoint_activations": recompute["granularity"] == "full"}


def with_choice(args, ds_config: dict, decision: dict):
    """The run's settings under the schedule "auto" chose: its ds_config, "pipeline" section and plan, and
    the recompute setting it chose ("auto_recompute"), for the build that follows (a new RunConfig)."""
    args = args.replace(ds_config=ds_config, pipeline_settings=pipeline_settings(ds_config))
    args = args.replace(**planned(args))
    if "recompute" in decision["choice"]:
        args = args.replace(**recomputed(args, decision["choice"]["recompute"]))
    return args


def check_schedule_shape(args):
    """The named schedule's rules on the flags (ZeRO stage, micro-batches, layers per virtual stage, Seq1F1B
    segments): args.pipeline_plan (and args.auto_plan), made here before any rank starts (it is torch-free)
    and handed to the model build (None under DeepSpeed's engine)."""
    settings = args.pipeline_settings  # the "pipeline" section, parsed once (merge_ds_config); passed down from here
    args.pipeline_plan = args.auto_plan = None
    if settings.stock and not is_cost_method(settings.partition_method):
        return
    sizes = args.gpt_config  # the "flops" cuts count the vocabulary padded later as 50304 (pipe/plan/partition.py)
    try:
        if settings.stock:
            stock_cost_bounds(sizes, settings, args.pipeline_model_parallel_size)
            return
        values = planned(args)
        args.pipeline_plan, args.auto_plan = values["pipeline_plan"], values["auto_plan"]
        if "gpt_config" in values:  # "auto_recompute": its start's setting
            args.gpt_config, args.checkpoint_activations = values["gpt_config"], values["checkpoint_activations"]
        chunk_cost_bounds(settings.partition_method, sizes, args.pipeline_plan.placement,  # the build cuts again
                          settings.vocab_parallel)
    except ConfigError as exc:
        how = (f" (micro-batches per step = --global-batch-size {args.global_batch_size} / (--micro-batch-size "
               f"{args.micro_batch_size} x data-parallel {args.data_parallel_size}))" if "micro_batches" in str(exc)
               else "")
        raise ArgumentsError(f"{exc}{how}") from None
