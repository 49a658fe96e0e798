"""The engine of a Hugging Face causal LM cut into a PipelineModule (cut.py): pretrain_gpt.py --hf-model's, and
Seq1F1B's for such a model. The module goes the path megatron_ds.initialize takes for a user's own module
(pipe/foreign/foreign.py: the schedule's chunks), or to DeepSpeed's own engine when the ds_config names no schedule. The
optimizer and lr schedule are built by the caller over the module the engine runs (the training layer's).

Seq1F1B: the cut's layers take a micro-batch's sequence in segments, since their attention (attention.py) keeps
earlier segments' keys and values in the engine's SegmentKVCache; HFScheduleEngine hands each F its segment of
the token and position ids and the loss its segment's labels with the micro-batch's scored token count, and opens
the micro-batch's packed documents (found from its whole position ids) around each op: a segment's queries see
the cached keys of their own document only.

Context parallelism (`cp` > 1, `comm_type` as --cp-comm-type): the topology's data axis is DP x CP, CP inner, as
for our GPT (pipe/parallel/context_parallel.py); each op's token ids, position ids and labels are this rank's two
chunks of them (the position ids travel with the hidden states, so every decoder layer's rotary rotates its tokens
by theirs), and the attention runs over the CP group, which the engine opens around each op with the documents.
Every stage reads the micro-batches then (the documents are the whole sequence's).

"auto": the plan and its AutoPlan are made from the model (plan_sizes: its config's layer count, sizes and
vocabulary, and whether its layers' MLP is gated, as make_plan reads a GPTConfig), the run starts on auto's start-up schedule and the engine times the
cut's own layers (the embedding, decoder layers, final norm and head as they run) in its window, as for the GPT
(pipe/auto.py); a choice placed otherwise is a rebuild through a checkpoint by the engine's owner
(training/auto_schedule.switch_engine), with the same transformers model.
"""
import contextlib
import dataclasses
import types

import torch
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

from megatron_ds.model.context_parallel import context_parallel_group
from megatron_ds.model.context_parallel.a2a import heads_problem
from megatron_ds.model.documents import opened

from ..build import initialize_engine
from ..foreign.foreign import check_settings, chunked, plan_for
from ..foreign.foreign_engine import ForeignScheduleEngine
from ..parallel.context_parallel import ensure_context_parallel, local_inputs
from ..plan.config import ConfigError
from ..plan.plan import make_plan
from ..plan.segments import context_shards, segment_lengths
from . import attention
from .cut import PARTITION, CutError, Parts, load, pipeline_module


class HFScheduleEngine(ForeignScheduleEngine):
    """ForeignScheduleEngine whose F ops take Seq1F1B's segments and context-parallel chunks of the (token ids,
    position ids), and whose ops run with the micro-batch's documents and the CP group open."""
    whole_batches = True  # the documents are found from a micro-batch's whole position ids

    def _inputs(self, mb, seq):
        inputs = self._batches[mb][0]
        if self.sched.seq_splits == 1 and self.context is None:
            return inputs
        if torch.is_tensor(inputs):  # token ids alone: positions 0..s-1, cut with them
            inputs = (inputs, _positions(inputs))
        cut = self.plan.segment(seq)
        return local_inputs(self.context, tuple(t[:, cut] for t in inputs))

    @contextlib.contextmanager
    def _open_segment(self, replica, stage, mb, seq):
        group = None if self.context is None else context_parallel_group(self.module)
        with super()._open_segment(replica, stage, mb, seq), opened(self._position_documents(mb)), \
                attention.context_parallel(group, getattr(self.module, "cp_comm_type", "p2p")):
            yield

    def _position_documents(self, mb):
        """Micro-batch `mb`'s documents (attention.PositionDocuments), made once an iteration, where a segment or
        a context-parallel rank needs them (a whole sequence's attention reads them from its position ids)."""
        if self._batches is None or (self.sched.seq_splits == 1 and self.context is None):
            return None
        if getattr(self, "_documents_of", None) is not self._batches:
            self._documents_of, self._position_docs = self._batches, {}
        if mb not in self._position_docs:
            inputs = self._batches[mb][0]
            self._position_docs[mb] = None if torch.is_tensor(inputs) else attention.PositionDocuments.of(inputs[1])
        return self._position_docs[mb]

    def scored_tokens(self, mb):
        return int((self._batches[mb][1] != -100).sum())


def _positions(ids):
    return torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)


def context_problem(config, cp, comm_type, seq_length):
    """Why `config`'s model cannot run under context parallelism `cp` by `comm_type` ('' when it can)."""
    if cp == 1:
        return ""
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    if window is not None and (seq_length is None or window < seq_length):
        return (f"a sliding window ({window} tokens, shorter than the sequence) under --context-parallel-size {cp}: "
                "the context-parallel attention has no window")
    if getattr(config, "attn_logit_softcapping", None):
        return f"capped attention scores (attn_logit_softcapping) under --context-parallel-size {cp}"
    if comm_type == "a2a":
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        return heads_problem(kv_heads, cp)
    return ""


def layer_shape(model):
    """The decoder layer's sizes as Seq1F1B's balanced cut weighs them (schedules/flops.layer_shape's fields)."""
    config = model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    # GPT-2 names n_inner (None: 4 h)
    ffn = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * config.hidden_size
    return types.SimpleNamespace(hidden_size=config.hidden_size, ffn_hidden_size=ffn, num_attention_heads=heads,
                                 num_key_value_heads=getattr(config, "num_key_value_heads", None) or heads,
                                 swiglu=gated_mlp(model, ffn),
                                 kv_channels=head_dim if head_dim * heads != config.hidden_size else None)


def gated_mlp(model, ffn):
    """Whether the decoder layers' MLP is gated (SwiGLU's kin: three FFN-wide projections, not two), from the
    first decoder layer's own weights: one named for a gate (LLaMA's gate_proj, Phi-3's fused gate_up_proj) `ffn`
    or 2 x `ffn` wide. The config does not say it: GPT-NeoX names intermediate_size for an ungated GELU MLP, as
    LLaMA does for its gated one; a router named gate (Mixtral's) is as wide as the experts are many."""
    layer = Parts(model).layers[0]
    return any(any("gate" in part for part in name.split(".")) and {ffn, 2 * ffn} & set(weight.shape)
               for name, weight in layer.named_parameters())


def plan_sizes(model, seq_length):
    """The model's sizes as make_plan reads a GPTConfig's (layers, hidden, FFN, heads, vocabulary, sequence):
    what "auto"'s budget, candidates and Seq1F1B cuts are made of."""
    shape = layer_shape(model)
    config = model.config
    shape.num_layers, shape.vocab_size, shape.max_position_embeddings = (config.num_hidden_layers,
                                                                         config.vocab_size, seq_length)
    return shape


def build_engine(source, ds_config, settings, pp, dp, make_optimizer, make_lr_scheduler=None,
                 activation_checkpoint_interval=0, seq_length=None, cp=1, comm_type="p2p", planned=None,
                 on_auto_decision=None):
    """(engine, the transformers model it trains): `make_optimizer(module)`, `make_lr_scheduler(optimizer)`;
    `seq_length`: the tokens of a micro-batch's sequence, which Seq1F1B's segments cut; `cp`, `comm_type`:
    context parallelism (--context-parallel-size, --cp-comm-type; `dp` the data-parallel size without it). Under
    "auto": `planned`, the (PipelinePlan, AutoPlan) the run made at parse time (None: made here from the model's
    config), and `on_auto_decision`, the owner's hook for the decision (pipe/auto.AutoDecision)."""
    model = load(source)
    problem = context_problem(model.config, cp, comm_type, seq_length)
    if problem:
        raise CutError(f"{type(model).__name__}: {problem}")
    if cp > 1 and (settings.stock or settings.auto):
        raise ConfigError(f"--context-parallel-size {cp} with a Hugging Face model under "
                          + ('"auto"' if settings.auto else 'DeepSpeed\'s own engine (no "pipeline.schedule")')
                          + ': name a schedule ("1f1b" is its order on our engine)')
    method = (ds_config.get("pipeline") or {}).get("partition_method", PARTITION)
    segmented = settings.seq_splits > 1 or settings.auto  # "auto" probes and may choose Seq1F1B's segments
    topology = PipeDataParallelTopology(num_pp=pp, num_dp=dp * cp)  # the data axis: DP x CP, CP inner
    module = pipeline_module(model, topology=topology,
                             partition_method=method, activation_checkpoint_interval=activation_checkpoint_interval,
                             dynamic_shape=segmented)  # segments of other lengths: each message says its shape
    engine_class, auto_plan = None, None
    if not settings.stock:
        check_settings(settings, ds_config, segments=True, auto=True)
        if seq_length is None and (segmented or cp > 1):
            raise ValueError("Seq1F1B's segments, \"auto\" and context parallelism need the sequence length")
        if settings.auto:
            plan, auto_plan = planned or make_plan(plan_sizes(model, seq_length), ds_config, pp, dp,
                                                   seq_length, settings)
        else:
            segments = None
            if segmented:
                shape = layer_shape(model)
                segments = (seq_length, shape.hidden_size, tuple(segment_lengths(settings, shape, seq_length)))
            plan = plan_for(module, ds_config, settings, segments, cp=cp)
            if segmented or cp > 1:  # every stage's attention needs the micro-batch's documents
                shards = context_shards(cp, 1, False, seq_length, segments and list(segments[2]))
                plan = dataclasses.replace(plan, documents=True, context_shards=shards)
        module = chunked(module, plan, method)
        module.context_layout = ensure_context_parallel(types.SimpleNamespace(context_parallel_size=cp), topology)
        module.context_parallel_size, module.cp_comm_type = cp, comm_type  # the engine opens the CP group
        engine_class = HFScheduleEngine
    optimizer = make_optimizer(module)
    lr_scheduler = make_lr_scheduler(optimizer) if make_lr_scheduler else None
    extra = {"engine_class": engine_class, "auto_plan": auto_plan, "on_auto_decision": on_auto_decision}
    engine = initialize_engine(module, ds_config, optimizer, lr_scheduler, settings=settings,
                               **(extra if engine_class else {}))
    return engine, model
