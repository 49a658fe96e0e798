"""One rank's side of vocabulary parallelism in ScheduleEngine (docs/SCHEDULES.md: Vocabulary
parallelism): the EF, S, T and EW ops on this rank's slice (model/vocab_slices.VocabSlice, with the
passes of model/vocab_parallel.py), and what they change in the transformer stages' ops: stage 0's
forward starts from the sum of every slice's rows, the loss stage's forward hands its output X to
every rank instead of computing a loss, its backward starts from the gradient the S passes' shares
make, and stage 0's backward hands its input's gradient to every rank's EW.

Data moves as the messages of vocab_messages.py; one a rank sends itself is kept here. The slices'
weight gradients are added into the parameters' .grad, as a W op's, so DeepSpeed's reduction and
ZeRO-1's step see them like any other.

With TP the TP ranks of a pipeline rank run the same ops at once, each on its part of the block
(model/vocab_parallel.py sums over them inside EF and S); the messages go between the pipeline ranks
of one TP rank. Under SP they carry this TP rank's shard of the tokens, but for the statistics,
which cover every token (T weighs every token, and every TP rank reports the whole loss).
"""
import torch

from megatron_ds.model import vocab_parallel as vp
from megatron_ds.model.linear import accumulate_grad
from megatron_ds.model.tensor_parallel import comm
from megatron_ds.schedules.kinds import EF, EW, S, T

from ..parallel.context_parallel import local_inputs, local_labels
from ..plan.vocab_messages import EGRAD, EMB, FLOAT32, HID, SHARE, STAT, key, vocab_outgoing


class VocabPasses:
    """Held by the engine; `start` opens an iteration, `finish` closes it."""

    def __init__(self, engine):
        self.engine = engine
        self.slice = engine.module.vocab_slice
        self.rank = engine.stage_id
        self._tp = (self.slice.group, self.slice.sequence_parallel)  # the passes' TP group and SP
        self.sched, self.ops, self.train = None, [], True
        self.kept = {}        # message key -> tensor: sent to this rank by itself, or received and still needed
        self.slices = {}      # unit -> SliceStatistics, from this rank's S to its T
        self.merged = {}      # unit -> [loss per token, alphas, uses left]

    @staticmethod
    def dtype_of(message_key, dtype):
        return torch.float32 if message_key[0] in FLOAT32 else dtype

    def start(self, schedule, ops, train):
        """An iteration of `schedule` whose ops on this rank are `ops`."""
        self.sched, self.ops, self.train = schedule, ops, train

    # -- messages ----------------------------------------------------------------------------------
    def _send(self, op, payloads: dict):
        for message_key, dst in vocab_outgoing(self.sched, op, self.train):
            tensor = payloads[message_key[0]].detach()
            if dst == self.rank:
                self.kept[message_key] = tensor
            else:
                self.engine.p2p.send(message_key, dst, tensor)

    def _fetch(self, message_key, keep=False):
        """A message to this rank (kept for another use when `keep`)."""
        tensor = self.kept.pop(message_key, None)
        if tensor is None:
            tensor = self.engine.tracer.wait(self.engine.p2p.recv, message_key)
        if keep:
            self.kept[message_key] = tensor
        return tensor

    # -- data --------------------------------------------------------------------------------------
    def _tokens(self, op):
        (tokens, _), _ = self.engine.micro_batch(op.mb)
        return local_inputs(self.engine.context, (tokens[:, self.engine.plan.segment(op.seq)],))[0]  # on the device

    def _labels(self, op):
        """(this segment's labels, the scored token count of its whole micro-batch: a segment's losses are
        divided by it, so they add up to the micro-batch's mean); under context parallelism this rank's labels
        of the segment and the count / CP (pipe/parallel/context_parallel.py)."""
        _, labels = self.engine.micro_batch(op.mb)
        labels, tokens = labels[:, self.engine.plan.segment(op.seq)], self.engine.scored_tokens(op.mb)
        return (labels, tokens) if self.engine.context is None else local_labels(self.engine.context, labels, tokens)

    def _grad_loss(self, op):
        """d(the step's loss) / d(one token's loss): the engine's loss scaling of a mean token loss; per token
        under --eod-mask-loss (0 for a token not scored)."""
        labels, tokens = self._labels(op)
        if self.engine.loss_masked:
            return self.engine.scale_loss((labels >= 0).float() / tokens)
        return self.engine.scale_loss(torch.tensor(1.0 / tokens, dtype=torch.float32, device=self.engine.device))

    # -- the vocabulary ops ------------------------------------------------------------------------
    def run(self, op):
        """The pass of vocabulary op `op` (EF, S, T or EW)."""
        {EF: self.embedding_forward, S: self.s_pass, T: self.t_pass, EW: self.embedding_weight_grad}[op.kind](op)

    def embedding_forward(self, op):
        """EF: this slice's rows of the lookup, to stage 0's rank."""
        with torch.no_grad():
            rows = vp.embedding_forward(self._tokens(op), self.slice.wte, self.slice.start, *self._tp)
        self._send(op, {EMB: rows})

    def s_pass(self, op):
        """S: the slice's statistics and input-gradient share, to the ranks that need them."""
        hidden = self._fetch(key(HID, op, self.sched.loss_stage), keep=self.train)
        labels, _ = self._labels(op)
        with torch.no_grad():
            s = vp.output_s_pass(hidden, self.slice.output_weight, labels, self.slice.start, *self._tp,
                                 chunk=self.slice.loss_chunk_size)
        if self.train:
            self.slices[op.unit] = s
        self._send(op, {STAT: vp.statistics_message(s), SHARE: vp.share_message(s)})

    def t_pass(self, op):
        """T: the slice's weight gradient, once every slice's statistics are here."""
        hidden = self._fetch(key(HID, op, self.sched.loss_stage))
        _, alphas = self._statistics(op)
        stats = vp.Statistics(loss=None, alpha=alphas[op.stage], input_grad=None)
        with torch.no_grad():
            grad = vp.output_t_pass(self.slices.pop(op.unit), stats, hidden, self._grad_loss(op), *self._tp,
                                    weight=self.slice.output_weight, chunk=self.slice.loss_chunk_size)
        accumulate_grad(self.slice.output_weight, grad.to(self.slice.output_weight.dtype))

    def embedding_weight_grad(self, op):
        """EW: the gradient of this slice's rows, from stage 0's input gradient."""
        grad_output = self._fetch(key(EGRAD, op, 0))
        with torch.no_grad():
            grad = vp.embedding_weight_grad(self._tokens(op), grad_output, self.slice.wte.shape[0], self.slice.start,
                                            *self._tp)
        accumulate_grad(self.slice.wte, grad.to(self.slice.wte.dtype))

    # -- the transformer stages' ends --------------------------------------------------------------
    def embedding_sum(self, op):
        """Stage 0's forward input: every slice's rows added, in slice order."""
        rows = [self._fetch(key(EMB, op, j)) for j in range(self.sched.pp)]
        return sum(rows[1:], rows[0])

    def hidden_out(self, op, hidden):
        """The loss stage's forward output X, to every rank's S (and T)."""
        self._send(op, {HID: hidden})

    def loss_input_grad(self, op, hidden):
        """The loss stage's output gradient: sum_j (alpha_j P_j W_j - W_j[target]), per token scaled."""
        _, alphas = self._statistics(op)
        grad_loss = self._grad_loss(op)
        if self.slice.sequence_parallel:  # the statistics cover every token, the shares this rank's shard
            alphas = comm.split(alphas, -1, self.slice.group)
            grad_loss = comm.split(grad_loss, -1, self.slice.group) if grad_loss.dim() else grad_loss
        shares = [self._fetch(key(SHARE, op, j)) for j in range(self.sched.pp)]
        return vp.merged_input_grad(alphas, shares, grad_loss).to(hidden.dtype)

    def embedding_grad_out(self, op, grad):
        """Stage 0's input gradient, to every rank's EW."""
        self._send(op, {EGRAD: grad})

    # -- statistics and loss -----------------------------------------------------------------------
    def _statistics(self, op):
        """(loss per token, every slice's alpha) of op's micro-batch (and segment): merged once from
        every slice's statistics; on the loss stage's rank its loss joins the engine's sum."""
        unit = (op.replica, 0, op.mb, op.seq)
        entry = self.merged.get(unit)
        if entry is None:
            loss, alphas = vp.merge_statistics([self._fetch(key(STAT, op, j)) for j in range(self.sched.pp)])
            on_loss_rank = self.rank == self.sched.rank_of(op.replica, self.sched.loss_stage)
            if on_loss_rank:
                labels, tokens = self._labels(op)
                self.engine.add_loss(loss.masked_fill(labels < 0, 0.0).sum() / tokens)
            entry = self.merged[unit] = [loss, alphas, 2 if on_loss_rank and self.train else 1]
        entry[2] -= 1
        if entry[2] == 0:
            del self.merged[unit]
        return entry[0], entry[1]

    def finish(self):
        """Evaluation: the loss stage's rank merges every micro-batch's statistics now (no op waits
        for them). Then nothing may be left over."""
        if not self.train:
            for op in self.ops:
                if op.kind is S and self.rank == self.sched.rank_of(op.replica, self.sched.loss_stage):
                    self._statistics(op)
        left = [*self.kept, *self.slices, *self.merged]
        self.kept.clear()
        self.slices.clear()
        self.merged.clear()
        return left
