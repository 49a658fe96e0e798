"""The engine of a Hugging Face causal LM cut into a PipelineModule (cut.py): pretrain_gpt.py --hf-model's, and
Seq1F1B's for such a model. The module goes the path megatron_ds.initialize takes for a user's own module
(pipe/foreign/foreign.py: the schedule's chunks), or to DeepSpeed's own engine when the ds_config names no schedule. The
optimizer and lr schedule are built by the caller over the module the engine runs (the training layer's).

Seq1F1B: the cut's layers take a micro-batch's sequence in segments, since their attention (attention.py) keeps
earlier segments' keys and values in the engine's SegmentKVCache; HFScheduleEngine hands each F its segment of
the token and position ids and the loss its segment's labels with the micro-batch's scored token count.

"auto": the plan and its AutoPlan are made from the model's config (plan_sizes: its layer count, sizes and
vocabulary, as make_plan reads a GPTConfig), the run starts on auto's start-up schedule and the engine times the
cut's own layers (the embedding, decoder layers, final norm and head as they run) in its window, as for the GPT
(pipe/auto.py); a choice placed otherwise is a rebuild through a checkpoint by the engine's owner
(training/auto_schedule.switch_engine), with the same transformers model.
"""
import types

import torch
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

from ..build import initialize_engine
from ..foreign.foreign import check_settings, chunked, plan_for
from ..foreign.foreign_engine import ForeignScheduleEngine
from ..plan.plan import make_plan
from ..plan.segments import segment_lengths
from .cut import PARTITION, load, pipeline_module


class HFScheduleEngine(ForeignScheduleEngine):
    """ForeignScheduleEngine whose F ops take Seq1F1B's segments of the (token ids, position ids)."""

    def _inputs(self, mb, seq):
        inputs = self._batches[mb][0]
        if self.sched.seq_splits == 1:
            return inputs
        if torch.is_tensor(inputs):  # token ids alone: positions 0..s-1, cut with them
            inputs = (inputs, torch.arange(inputs.shape[1], device=inputs.device).expand(inputs.shape[0], -1))
        cut = self.plan.segment(seq)
        return tuple(t[:, cut] for t in inputs)

    def scored_tokens(self, mb):
        return int((self._batches[mb][1] != -100).sum())


def layer_shape(config):
    """The decoder layer's sizes as Seq1F1B's balanced cut weighs them (schedules/flops.layer_shape's fields)."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    # a config naming intermediate_size has a gated MLP (LLaMA's kin); GPT-2's names n_inner (None: 4 h), ungated
    gated = getattr(config, "intermediate_size", None) is not None
    ffn = config.intermediate_size if gated else (getattr(config, "n_inner", None) or 4 * config.hidden_size)
    return types.SimpleNamespace(hidden_size=config.hidden_size, ffn_hidden_size=ffn, num_attention_heads=heads,
                                 num_key_value_heads=getattr(config, "num_key_value_heads", None) or heads,
                                 swiglu=gated, kv_channels=head_dim if head_dim * heads != config.hidden_size else None)


def plan_sizes(config, seq_length):
    """The model's sizes as make_plan reads a GPTConfig's (layers, hidden, FFN, heads, vocabulary, sequence):
    what "auto"'s budget, candidates and Seq1F1B cuts are made of."""
    shape = layer_shape(config)
    shape.num_layers, shape.vocab_size, shape.max_position_embeddings = (config.num_hidden_layers,
                                                                         config.vocab_size, seq_length)
    return shape


def build_engine(source, ds_config, settings, pp, dp, make_optimizer, make_lr_scheduler=None,
                 activation_checkpoint_interval=0, seq_length=None, planned=None, on_auto_decision=None):
    """(engine, the transformers model it trains): `make_optimizer(module)`, `make_lr_scheduler(optimizer)`;
    `seq_length`: the tokens of a micro-batch's sequence, which Seq1F1B's segments cut. Under "auto":
    `planned`, the (PipelinePlan, AutoPlan) the run made at parse time (None: made here from the model's
    config), and `on_auto_decision`, the owner's hook for the decision (pipe/auto.AutoDecision)."""
    model = load(source)
    method = (ds_config.get("pipeline") or {}).get("partition_method", PARTITION)
    segmented = settings.seq_splits > 1 or settings.auto  # "auto" probes and may choose Seq1F1B's segments
    module = pipeline_module(model, topology=PipeDataParallelTopology(num_pp=pp, num_dp=dp),
                             partition_method=method, activation_checkpoint_interval=activation_checkpoint_interval,
                             dynamic_shape=segmented)  # segments of other lengths: each message says its shape
    engine_class, auto_plan = None, None
    if not settings.stock:
        check_settings(settings, ds_config, segments=True, auto=True)
        if seq_length is None and segmented:
            raise ValueError("Seq1F1B's segments and \"auto\" need the sequence length")
        if settings.auto:
            plan, auto_plan = planned or make_plan(plan_sizes(model.config, seq_length), ds_config, pp, dp,
                                                   seq_length, settings)
        else:
            segments = None
            if segmented:
                shape = layer_shape(model.config)
                segments = (seq_length, shape.hidden_size, tuple(segment_lengths(settings, shape, seq_length)))
            plan = plan_for(module, ds_config, settings, segments)
        module = chunked(module, plan, method)
        engine_class = HFScheduleEngine
    optimizer = make_optimizer(module)
    lr_scheduler = make_lr_scheduler(optimizer) if make_lr_scheduler else None
    extra = {"engine_class": engine_class, "auto_plan": auto_plan, "on_auto_decision": on_auto_decision}
    engine = initialize_engine(module, ds_config, optimizer, lr_scheduler, settings=settings,
                               **(extra if engine_class else {}))
    return engine, model



