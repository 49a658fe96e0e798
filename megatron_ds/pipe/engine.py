"""ScheduleEngine: a DeepSpeed PipelineEngine that runs any megatron_ds schedule.

The schedule (pure data from megatron_ds.schedules) gives each rank its ordered
ops; this engine interprets them. Activations and gradients live in per-(replica,
stage, mb, seq) buffers; edges between ranks become isend/irecv pairs planned by
messages.MessagePlan, edges inside a rank are local hand-overs. Each chunk's forward
starts from a detached leaf, so every (stage, mb, seq) has its own autograd graph
and B, W and BW can run in any order the schedule picks. Gradient reduction,
ZeRO-1, clipping, the optimizer step and checkpoints are DeepSpeed's own.
"""
import contextlib

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe.engine import PipelineEngine

from megatron_ds.model.documents import opened
from megatron_ds.model.kv_cache import SegmentKVCache
from megatron_ds.model.linear import WeightGradStore
from megatron_ds.model.moe import expert_parallel_size
from megatron_ds.model.weight_carriers import Carriers
from megatron_ds.schedules import Op
from megatron_ds.schedules.kinds import VOCAB, Kind

from .deepspeed import ds_internals as ds
from . import instructions as ins
from .activations import detached, input_grads, leaves
from .auto import AutoSwitch
from .parallel.context_parallel import local_inputs, local_labels
from .plan.messages import incoming_key, message_key, outgoing
from .moe.overlap import OverlapRunner, side_state
from .p2p import P2P
from .post_validation import PostValidation
from .replicas import idle_chunks
from .parallel.sequence_parallel import with_sequence_parallel_reduction
from .trace import Tracer, through_tracer
from .vocab.vocab_passes import VocabPasses


LAYOUT_KEY = "megatron_ds_pipeline_layout"


def vocab_handler(kind):
    """The instruction handler of vocabulary op `kind` (EF, S, T, EW)."""
    def run(engine, replica, stage, mb, seq):
        engine._exec_vocab_op(replica, stage, mb, seq, kind)
    return run


class ScheduleEngine(PipelineEngine):
    """DeepSpeed's template methods it overrides: _train_schedule and _inference_schedule (the op
    lists), _exec_schedule (to bracket it with the tracer), _aggregate_total_loss, eval_batch,
    set_dataiterator, save_checkpoint (to record the layout), _take_model_step (post-validation's
    optimizer step, megatron_ds/pipe/post_validation.py), and _INSTRUCTION_MAP (DeepSpeed's own
    handlers for the step's reductions and optimizer step, ours for the ops; ReduceTiedGrads first sums
    the sequence-parallel gradients over the TP group, see sequence_parallel.py). The signatures they are
    written against, and every other private of DeepSpeed's it touches: ds_internals.py."""

    def __init__(self, *args, plan, auto_plan=None, tracer=None, on_auto_decision=None, **kwargs):
        self.plan = plan  # the PipelinePlan the module was cut by (pipe/plan/plan.py); "auto" swaps in one placed alike
        self.tracer = tracer or Tracer()
        # gloo moves a message only once its receive is posted: there every receive of an iteration whose shape
        # is known is posted at its start (_exec_load_micro_batches; P2P.post_all says why not on NCCL)
        self.posts_all = dist.get_backend() == "gloo"
        super().__init__(*args, **kwargs)
        # Set by _start for each iteration: its schedule, the receive to post ahead of each op,
        # the ops after which a chunk's twin-gradient sync starts, the p2p state, the loss sum.
        self.sched, self._ahead, self._sync_after, self.p2p = None, {}, {}, None
        self._batches = None
        # packed documents (model/documents.py): each micro-batch's Documents and scored-token count
        self.packing = getattr(self.module, "packing", None)
        self._documents, self._scored = None, None
        # context parallelism: this rank's ContextLayout, whose shard of each op's tokens and labels it computes
        self.context = getattr(self.module, "context_layout", None)
        self._stash = {}  # (replica, stage, mb, seq) -> (input leaf, output or loss)
        self._local = {}  # message key -> tensor handed over between chunks of this rank
        self._wgrad = {}  # (replica, stage, mb, seq) -> queued weight GEMMs
        # Seq1F1B: earlier segments' keys/values, per ((replica, stage), mb); CUDA graphs need their memory static
        self._kv = SegmentKVCache(static=plan.settings.cuda_graphs)
        self._carriers = {}  # chunk -> Carriers of its compiled linears' weight GEMMs (or None)
        self._dtype = next(self.module.parameters()).dtype
        self._loss_sum = None
        self._post_validation = (PostValidation(self, loss_sum=lambda: self._loss_sum)
                                 if plan.settings.post_validation else None)
        self.auto = AutoSwitch(self, auto_plan) if auto_plan else None  # "schedule": "auto", until it decides
        self.vocab = VocabPasses(self) if plan.settings.vocab_parallel else None  # the vocabulary slice's passes
        self.on_auto_decision = on_auto_decision  # the owner's hook: called once with "auto"'s AutoDecision (pipe/auto.py)
        self._overlap_runner = None  # runs overlapped units (pipe/moe/overlap.py), made at the first
        self.overlapped_units_run = 0  # units this rank ran, all iterations: the log confirms them (training/loop.py)

    def use_plan(self, plan) -> None:
        """Run `plan` from the next iteration: another schedule ("auto"'s probe, its choice) over the chunks as
        the module is cut; a plan placing them otherwise needs the module rebuilt (training/auto_schedule.py)."""
        if [list(row) for row in plan.placement] != [list(row) for row in self.plan.placement]:
            raise RuntimeError(f"a plan placing the chunks {plan.placement} on an engine whose module is cut for "
                               f"{self.plan.placement}: rebuild the module for it")
        self.plan = plan

    def train_batch(self, data_iter=None):
        if self.auto is None:
            return super().train_batch(data_iter)
        return self.auto.train_batch(lambda: super(ScheduleEngine, self).train_batch(data_iter))

    # -- schedule ------------------------------------------------------------------------------
    def _start(self, micro_batches, train):
        if self.plan.settings.cuda_graphs:
            # One generation of inductor's CUDA graphs per iteration: by default a generation ends at the
            # first backward after forwards, which would overwrite the outputs micro-batches still in
            # flight (every schedule but PP=1's 1F1B keeps some) hold for their backward.
            torch.compiler.cudagraph_mark_step_begin()
        program = self.plan.program(self.stage_id, micro_batches, train)
        self.sched, ops, self._ahead = program.schedule, program.ops, program.ahead
        sync = self.module.replica_sync if train else None
        self._sync_after = last_backward_ops(ops) if sync else {}
        if sync:
            sync.start_step(idle_chunks(program.schedule, self.module.chunks))
        self.p2p = self._new_p2p(program.messages)
        if self.vocab:
            self.vocab.start(program.schedule, ops, train)
        self._loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        paired = program.schedule.paired_at(self.stage_id) if train else frozenset()  # evaluation runs forwards alone
        return ins.OpListSchedule(ops, micro_batches, self.num_stages, self.stage_id, train=train, paired=paired)

    def _new_p2p(self, messages):
        """This iteration's P2P (a user's own PipelineModule's learns its shapes: pipe/foreign/learned_p2p.py)."""
        return P2P(messages, self.stage_id, lambda r: self.grid.stage_to_global(stage_id=r),
                   self.plan.message_shape, lambda key: VocabPasses.dtype_of(key, self._dtype), self.device)

    def _exec_schedule(self, pipe_schedule):
        with self.tracer.iteration(self):
            super()._exec_schedule(pipe_schedule)

    def _train_schedule(self):
        return self._start(self.micro_batches, train=True)

    def _inference_schedule(self, micro_batches):
        return self._start(micro_batches, train=False)

    def _take_model_step(self, lr_kwargs):
        # DeepSpeed's step, overflow count and lr schedule, with post-validation's optimizer step
        if self._post_validation is None:
            return super()._take_model_step(lr_kwargs)
        zero, self.optimizer = self.optimizer, self._post_validation.optimizer()
        try:
            return super()._take_model_step(lr_kwargs)
        finally:
            self.optimizer = zero

    # -- data ----------------------------------------------------------------------------------
    def set_dataiterator(self, iterator):
        self.training_dataloader = None
        self.data_iterator = iterator

    def _exec_load_micro_batches(self):
        if self.posts_all:  # inside the instruction, so that a trace holds the posting
            self.p2p.post_all()
        self._batches = self._documents = self._scored = None
        if self.plan.needs_data(self.stage_id):
            batches = [next(self.data_iterator) for _ in range(self.sched.micro_batches)]
            if self.packing is not None:
                self._read_documents(batches)
            self._batches = [self._on_device(batch) for batch in batches]
            lengths = self.plan.segment_lengths
            if lengths and any(labels.shape[1] != sum(lengths) for _, labels in self._batches):
                raise RuntimeError(f"seq_splits={self.sched.seq_splits} cuts {sum(lengths)}-token sequences into "
                                   f"{lengths}; a micro-batch has another length")

    def _read_documents(self, batches):
        """Each micro-batch's documents, from its tokens as they came (on the host: the attention groups are
        planned there), and the count of tokens its loss scores (--eod-mask-loss leaves some out)."""
        self._documents = [self.packing.documents(tokens, positions) for (tokens, positions), _ in batches]
        self._documents = [None if d is None else d.to(self.device) for d in self._documents]
        if self.packing.eod_mask_loss:
            self._scored = [int((labels >= 0).sum()) for _, labels in batches]

    def micro_batch(self, mb):
        """Micro-batch `mb` of this iteration, ((tokens, position_ids), labels), on the device."""
        return self._batches[mb]

    @property
    def loss_masked(self):
        """Whether this iteration's losses leave some tokens out (--eod-mask-loss: scored_tokens counts the rest)."""
        return self._scored is not None

    def scored_tokens(self, mb):
        """The tokens whose loss micro-batch `mb` scores: a Seq1F1B segment's loss sum is divided by it."""
        _, labels = self._batches[mb]
        return self._scored[mb] if self._scored is not None else labels.numel()

    def _on_device(self, batch):
        """A micro-batch moved to the device once: a copy from pageable memory synchronises the host (the
        stock engine's count), which Seq1F1B would pay again per segment; segments are views of it."""
        inputs, labels = batch
        return tuple(t.to(self.device) for t in inputs), labels.to(self.device)

    def _inputs(self, mb, seq):
        inputs, _ = self._batches[mb]
        cut = self.plan.segment(seq)
        return local_inputs(self.context, tuple(t[:, cut] for t in inputs))

    def _labels(self, mb, seq):
        _, labels = self._batches[mb]
        if self.context is not None:  # this rank's tokens of the segment, over the micro-batch's count / CP
            return local_labels(self.context, labels[:, self.plan.segment(seq)], self.scored_tokens(mb))
        if self.sched.seq_splits == 1:
            return labels
        # A segment's loss is divided by the whole micro-batch's token count: they sum to its loss.
        return labels[:, self.plan.segment(seq)], self.scored_tokens(mb)

    @contextlib.contextmanager
    def _open_segment(self, replica, stage, mb, seq):
        """Attention sees the K/V cache of (replica, stage, mb) while an op on segment `seq` runs, and the
        micro-batch's packed documents (every stage holds its whole token sequence: a segment's keys of
        earlier segments know their documents too)."""
        segment = contextlib.nullcontext()
        if self.sched.seq_splits > 1:
            cut = self.plan.segment(seq)
            segment = self._kv.segment(((replica, stage), mb), cut.start, cut.stop, sum(self.plan.segment_lengths))
        with segment, opened(self._documents[mb] if self._documents else None):
            yield

    def _carry_weight_grads(self, chunk, seq):
        """A compiled chunk that defers weight gradients hands them out of its graphs in carriers
        (model/weight_carriers.py) while a training forward runs."""
        if chunk not in self._carriers:
            layers = [f for f in self.module.chunk_funcs[chunk] if isinstance(f, torch.nn.Module)]
            # checkpointed layers run their forward without autograd and their recomputation outside
            # any forward op: there is nothing to carry
            checkpointed = self.module.activation_checkpoint_interval > 0
            self._carriers[chunk] = None if checkpointed else Carriers.of(layers)
        carriers = self._carriers[chunk]
        if carriers is None or not (self.module.training and torch.is_grad_enabled()):
            return contextlib.nullcontext()
        return carriers.forward((self.plan.micro_batch_size, self.plan.local_length(seq)))

    # -- p2p and hand-over -----------------------------------------------------------------------
    def _emit(self, op, tensor):
        out = outgoing(self.sched, self.stage_id, op)
        if out is None:
            self._local[message_key(op)] = detached(tensor)
        else:
            key, dst = out
            self.p2p.send(key, dst, tensor)

    def _post_ahead(self, op):
        """Post the next receiving op's irecv as `op` starts: its message moves while `op` runs."""
        for key in self._ahead.get(op, ()):
            self.p2p.post(key, block=False)

    def _take(self, op):
        key = incoming_key(op)
        if key in self._local:
            return self._local.pop(key)
        return self.tracer.wait(self.p2p.recv, key)

    # -- compute ---------------------------------------------------------------------------------
    def _exec_forward_op(self, replica, stage, mb, seq):
        op = Op(Kind.F, replica, stage, mb, seq)
        x = self._forward_input(op)
        self._forward_output(op, x, self._forward_compute(op, x))

    def _forward_input(self, op):
        self._post_ahead(op)
        if op.stage == 0 and self.vocab:
            return self.vocab.embedding_sum(op).requires_grad_(self.module.training), self._inputs(op.mb, op.seq)[1]
        if op.stage == 0:
            return self._inputs(op.mb, op.seq)
        return leaves(self._take(op), self.module.training)

    def _forward_compute(self, op, x):
        """The chunk's output, or on the loss stage the loss (under vocabulary parallelism: the hidden output)."""
        replica, stage, mb, seq = op.unit
        with self._open_segment(replica, stage, mb, seq), self._carry_weight_grads((replica, stage), seq):
            out = self.module.chunk_forward((replica, stage), x)
        if not self.module.training and seq == self.sched.seq_splits - 1:
            self._kv.free(((replica, stage), mb))
        if stage == self.sched.loss_stage and not self.vocab:
            return self._stage_loss(out, mb, seq)
        return out

    def _forward_output(self, op, x, out):
        if op.stage == self.sched.loss_stage and self.vocab:  # the loss comes of every rank's S pass
            self.vocab.hidden_out(op, out)
        elif op.stage == self.sched.loss_stage:
            self.add_loss(out)
        else:
            self._emit(op, out)
        if self.module.training:
            self._stash[op.unit] = (x, out)

    def _backward(self, replica, stage, mb, seq, kind):
        op = Op(kind, replica, stage, mb, seq)
        x, root, grad = self._backward_input(op)
        self._backward_compute(op, x, root, grad)
        self._backward_output(op, x)

    def _backward_input(self, op):
        """(the chunk's input leaves, the root to run backward from, its gradient: None at the loss)."""
        self._post_ahead(op)
        x, out = self._stash.pop(op.unit)
        if op.stage == self.sched.loss_stage and self.vocab:
            return x, out, self.vocab.loss_input_grad(op, out)
        if op.stage == self.sched.loss_stage:
            return x, self.scale_loss(out), None
        return x, out, self._take(op)

    def _backward_compute(self, op, x, root, grad):
        # DeepSpeed's activation checkpoint recomputes through the module's forward_funcs: the active chunk's
        self.module.activate((op.replica, op.stage))
        with ds.engine_backward(self):
            self._backward_pass(op.unit, op.kind, root, grad, x)

    def _backward_output(self, op, x):
        if op.seq == 0:
            self._kv.free(((op.replica, op.stage), op.mb))  # segment 0 runs the micro-batch's last backward here
        if op.stage > 0:
            self._emit(op, input_grads(x))
        elif self.vocab:
            self.vocab.embedding_grad_out(op, x[0].grad)
        self._backward_done(op)

    def _exec_overlapped_ops(self, ops):
        """An overlapped unit (pipe/moe/overlap.py): both ops' inputs taken first, the F computed here and the B or
        BW on the unit's second thread, each one's all-to-all in flight while the other computes, both outputs
        handed on after, in list order (the validator proves that neither op needs the other's)."""
        inputs = [self._forward_input(op) if op.kind is Kind.F else self._backward_input(op) for op in ops]
        (f, x), (b, (bx, root, grad)) = sorted(zip(ops, inputs), key=lambda pair: pair[0].kind is not Kind.F)

        def backward():
            with self._open_segment(*b.unit):  # for recomputation (activation checkpointing)
                self._backward_compute(b, bx, root, grad)
        out = self._overlap().run(lambda: self._forward_compute(f, x), backward, backward_first=ops[0] is b)
        self.overlapped_units_run += 1
        for op in ops:
            if op is f:
                self._forward_output(f, x, out)
            else:
                self._backward_output(b, bx)

    def _overlap(self):
        if self._overlap_runner is None:
            self._overlap_runner = OverlapRunner(*side_state(self.module), self.device)
        return self._overlap_runner

    def _backward_pass(self, unit, kind, root, grad, x):
        """BW, or B with the linears' weight GEMMs queued for the W of `unit` (model/linear.py)."""
        if kind is Kind.B:
            with WeightGradStore.deferring(self._wgrad.setdefault(unit, [])):
                torch.autograd.backward(root, grad)
        else:
            torch.autograd.backward(root, grad)

    def _stage_loss(self, out, mb, seq):
        return self.module.loss_fn(out, self._labels(mb, seq))

    def _backward_done(self, op):
        if self._sync_after:
            self.module.replica_sync.after_backward(self._sync_after.get(op))

    def scale_loss(self, loss):
        """A micro-batch's loss as the step's loss counts it, to run backward from."""
        loss = loss / self.micro_batches  # the per-micro-batch mean, as DeepSpeed's GAS scaling
        scale = getattr(self.optimizer, "scale_if_loss", None)
        return scale(loss) if scale else loss

    def add_loss(self, loss):
        """Add a micro-batch's loss (or a segment's share of it) to the iteration's sum (_aggregate_total_loss)."""
        self._loss_sum += loss.detach().float()

    def _exec_backward_op(self, replica, stage, mb, seq):
        with self._open_segment(replica, stage, mb, seq):  # for recomputation (activation checkpointing)
            self._backward(replica, stage, mb, seq, Kind.BW)

    def _exec_backward_input_op(self, replica, stage, mb, seq):
        with self._open_segment(replica, stage, mb, seq):
            self._backward(replica, stage, mb, seq, Kind.B)

    def _exec_backward_weight_op(self, replica, stage, mb, seq):
        op = Op(Kind.W, replica, stage, mb, seq)
        self._post_ahead(op)
        self.module.activate((replica, stage))  # (as in B: a recomputation in W runs this chunk's layers)
        with ds.engine_backward(self):
            WeightGradStore.drain(self._wgrad.pop((replica, stage, mb, seq)))
        self._backward_done(op)

    def _exec_vocab_op(self, replica, stage, mb, seq, kind):
        op = Op(kind, replica, stage, mb, seq)
        self._post_ahead(op)
        self.vocab.run(op)

    def _exec_reduce_replica_grads(self):
        if self.module.replica_sync:
            self.module.replica_sync.wait()

    def _exec_finish_iteration(self):
        leftovers = self.vocab.finish() if self.vocab else []
        self.p2p.finish()
        leftovers += [k for k in (*self._stash, *self._wgrad)] if self.module.training else []
        leftovers += self._kv.keys()  # segment K/V caches never freed
        if leftovers or self._local:
            raise RuntimeError(f"rank {self.stage_id}: schedule left work undone: {leftovers or list(self._local)}")
        self._stash.clear()
        self._batches = self._documents = self._scored = None

    # -- loss ------------------------------------------------------------------------------------
    def _aggregate_total_loss(self):
        """Mean loss over micro-batches and DP ranks, on every rank (any rank may hold a loss stage)."""
        loss = self._loss_sum.clone()
        folded = self._post_validation.take_pipe_loss() if self._post_validation else None
        if folded is not None:  # reduced with the step's post-validation message
            loss = folded
        elif self.is_pipe_parallel:
            dist.all_reduce(loss, group=self.grid.get_pipe_parallel_group())
        loss /= self.sched.micro_batches
        self.dp_group_loss = loss.clone()
        if self.is_data_parallel:
            dist.all_reduce(loss, group=self.mpu.get_data_parallel_group())
            loss /= self.dp_world_size
        self.agg_additional_losses = None
        return loss

    def eval_batch(self, data_iter, return_logits=False, compute_loss=True, reduce_output="avg", bcast_loss=True,
                   num_micro_batches=None):
        if return_logits or not compute_loss or reduce_output != "avg":
            raise ValueError("the megatron_ds engine's eval_batch returns the mean loss only")
        self.module.eval()
        train_iterator = self.data_iterator
        self.set_dataiterator(data_iter)
        try:
            with torch.no_grad():
                self._exec_schedule(self._inference_schedule(num_micro_batches or self.micro_batches))
                loss = self._aggregate_total_loss()
        finally:
            self.set_dataiterator(train_iterator)
            self.module.train()
        return loss

    # -- checkpoints -----------------------------------------------------------------------------
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True, **kwargs):
        """Records the layout; what loads under another one is decided by training/checkpoint/save_load.py. Under
        vocabulary parallelism the layer files hold the whole matrices (pipe/vocab/vocab_checkpoint.py)."""
        state = dict(client_state or {})
        state[LAYOUT_KEY] = pipeline_layout(self)
        return super().save_checkpoint(save_dir, tag=tag, client_state=state, save_latest=save_latest, **kwargs)

    _INSTRUCTION_MAP = through_tracer(with_sequence_parallel_reduction({
        **ds.instruction_map(PipelineEngine),
        ins.LoadMicroBatches: _exec_load_micro_batches,
        ins.ForwardOp: _exec_forward_op,
        ins.BackwardOp: _exec_backward_op,
        ins.BackwardInputOp: _exec_backward_input_op,
        ins.BackwardWeightOp: _exec_backward_weight_op,
        ins.OverlappedOps: _exec_overlapped_ops,
        ins.FinishIteration: _exec_finish_iteration,
        **{ins.KIND_TO_INSTRUCTION[kind]: vocab_handler(kind) for kind in VOCAB},
        ins.ReduceReplicaGrads: _exec_reduce_replica_grads,
    }))


def last_backward_ops(ops):
    """{op: chunk} for the op after which each chunk's gradients are complete on this rank (a vocabulary
    op's stage names a slice, not a chunk)."""
    last = {}
    for op in ops:
        if op.kind is not Kind.F and not op.kind.traits.vocab:
            last[(op.replica, op.stage)] = op
    return {op: chunk for chunk, op in last.items()}


def pipeline_layout(engine):
    """What ZeRO's optimizer partitioning depends on: pipeline and DP sizes, chunk placement
    (DeepSpeed's stock engine: one stage per rank), "ep": the expert-parallel size where above 1, and under
    vocabulary parallelism "vocab_parallel":
    how its parameter names read without it (model/vocab_slices.whole_names)."""
    plan = getattr(engine, "plan", None)  # a ScheduleEngine's
    placement = [list(row) for row in plan.placement] if plan else [list(range(engine.num_stages))]
    layout = {"pp": engine.num_stages, "dp": engine.dp_world_size, "placement": placement}
    ep = expert_parallel_size(engine.module)
    if ep > 1:  # the experts' ZeRO shards are cut over their expert-data-parallel groups
        layout["ep"] = ep
    vocab = getattr(engine.module, "vocab_slice", None)
    if vocab is not None:
        layout["vocab_parallel"] = vocab.names
    return layout


def saved_layout(state):
    """The layout a checkpoint's mp_rank_00_model_states.pt was saved with (see pipeline_layout)."""
    if LAYOUT_KEY in state:
        return state[LAYOUT_KEY]
    pp, dp = state.get("mp_world_size"), state.get("dp_world_size")
    return {"pp": pp, "dp": dp, "placement": [list(range(pp))]} if pp else None
