"""ScheduleEngine for a user's own DeepSpeed PipelineModule (megatron_ds.initialize; pipe/foreign/foreign.py cuts it).

The schedule, its ops and messages are the GPT's; what differs is what a stage holds and how its backward
splits. Batches and messages are DeepSpeed's: (inputs, labels), each a tensor or a tuple of tensors, and
activations of shapes learned from the first micro-batch (pipe/foreign/learned_p2p.py). A B op splits any layer's
backward through autograd (pipe/foreign/autograd_split.py), our own linears keeping their queued weight GEMMs; a
chunk whose backward cannot be split runs it whole in B, which the log says once. The rest of DeepSpeed's
interface behaves as its engine's: the loss (or the model's own output as the loss), eval_batch's
compute_loss / reduce_output / return_logits, set_dataloader, is_first_stage / is_last_stage (here: holds
the first / the loss stage, which a V schedule puts on one rank), reset_activation_shape.
"""
import functools

import torch
from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing

from megatron_ds.model.linear import WeightGradStore
from megatron_ds.schedules.kinds import Kind

from ..deepspeed import ds_internals as ds
from .. import instructions as ins
from ..activations import detached, floating
from .autograd_split import Split
from .foreign_context import local_batch
from ..plan.config import ConfigError
from ..engine import ScheduleEngine
from .learned_p2p import LearnedP2P, Shapes


def chunk_parameters(module, chunk):
    """The trainable parameters chunk `chunk`'s layers use (a tied module's in every chunk that uses it)."""
    seen, params = set(), []
    for f in module.chunk_funcs[chunk]:
        owner = f.args[0] if isinstance(f, functools.partial) else f
        if isinstance(owner, torch.nn.Module):
            for p in owner.parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
    return params


def on_device(tensors, device, requires_grad=False):
    """A batch part (a tensor or a tuple/list of tensors) on `device`, as DeepSpeed loads it."""
    if torch.is_tensor(tensors):
        return tensors.clone().detach().to(device).requires_grad_(requires_grad and tensors.is_floating_point())
    return tuple(on_device(t, device, requires_grad) for t in tensors)


def labels_on_device(labels, device):
    """Labels as DeepSpeed loads them: a tensor or a tuple/list of tensors on `device`, anything else (a
    placeholder such as 0 for a model without a loss) as given."""
    return on_device(labels, device) if torch.is_tensor(labels) or isinstance(labels, (tuple, list)) else labels


def _resetting_checkpoint_buffers(handler):
    """`handler` (a forward op's), then, in evaluation, DeepSpeed's contiguous activation-checkpoint buffers
    emptied, as its engine does after every evaluation forward: no backward frees them there."""
    def run(engine, **kwargs):
        handler(engine, **kwargs)
        if not engine.module.training:
            ds_checkpointing.reset()
    return run


class ForeignScheduleEngine(ScheduleEngine):
    whole_batches = False  # under CP: each micro-batch cut to this rank's tokens once, when loaded
    _INSTRUCTION_MAP = {**ds.instruction_map(ScheduleEngine),
                        ins.ForwardOp: _resetting_checkpoint_buffers(ds.instruction_map(ScheduleEngine)[ins.ForwardOp])}

    def __init__(self, *args, **kwargs):
        self._placed = False  # DeepSpeed's __init__ pairs its warm-up sends by stage id: its own answers until then
        super().__init__(*args, **kwargs)
        self._shapes = Shapes(dynamic=self.module.dynamic_shape)
        self._chunk_params = {c: chunk_parameters(self.module, c) for c in self.module.chunks}
        self._computes_loss, self._outputs, self._said = True, None, set()
        self.weights_in_w = 0  # parameter gradients B ops have left to their W ops (through autograd), so far
        chunks = self.plan.schedule.chunks_on(self.stage_id)
        self._first = any(stage == 0 for _, stage in chunks)
        self._last = any(stage == self.plan.schedule.loss_stage for _, stage in chunks)
        self._placed = True

    def is_first_stage(self):
        return self._first if self._placed else super().is_first_stage()

    def is_last_stage(self):
        return self._last if self._placed else super().is_last_stage()

    def set_dataloader(self, loader):
        if self.plan.needs_data(self.stage_id):
            self.training_dataloader = loader
            self.data_iterator = iter(loader)

    def reset_activation_shape(self):
        super().reset_activation_shape()
        self._shapes.reset()

    def _new_p2p(self, messages):
        return LearnedP2P(messages, self.stage_id, lambda r: self.grid.stage_to_global(stage_id=r), self._shapes,
                          self.device)

    # -- data ----------------------------------------------------------------------------------
    def _on_device(self, batch):
        if self.batch_fn:
            batch = self.batch_fn(batch)
        # reentrant activation checkpointing needs the first stage's inputs to ask for gradients (DeepSpeed's rule)
        needs_grad = self.module.training and ds.reentrant_activation_checkpointing(self)
        inputs, labels = batch
        if self._cut_when_loaded:  # this rank's tokens of every tensor (foreign_context.py)
            inputs, labels = local_batch(self.context, self.module.loss_fn, inputs, labels)
        return on_device(inputs, self.device, needs_grad), labels_on_device(labels, self.device)

    def _inputs(self, mb, seq):
        return self._batches[mb][0]

    @property
    def _cut_when_loaded(self):
        """Under CP a user's module is handed its rank's tokens of each micro-batch once (no segments under CP);
        pipe.hf's engine keeps the whole and cuts per op (whole_batches)."""
        return self.context is not None and not self.whole_batches

    def _labels(self, mb, seq):
        if self._cut_when_loaded:
            return self._batches[mb][1]
        return super()._labels(mb, seq)

    def _stage_loss(self, out, mb, seq):
        computed = self._computes_loss and self.module.loss_fn is not None
        result = self.module.loss_fn(out, self._labels(mb, seq)) if computed else out  # or the model's own loss
        if self._outputs is not None:  # evaluation keeps each micro-batch's loss (or output) and output
            self._outputs[mb] = (detached(result), detached(out))
        if self._computes_loss and not (torch.is_tensor(result) and result.numel() == 1):
            raise TypeError(f"the loss must be a tensor of one element, got {type(result).__name__}"
                            + (f" of shape {tuple(result.shape)}" if torch.is_tensor(result) else ""))
        return result.reshape(()) if self._computes_loss else torch.zeros((), device=self.device)

    # -- backward --------------------------------------------------------------------------------
    def _backward_pass(self, unit, kind, root, grad, x):
        if grad is None:  # the loss stage's scaled loss
            roots, grads = [root], [None]
        else:
            kept = [(out, g) for out, g in zip(floating(root), (grad,) if torch.is_tensor(grad) else grad)
                    if out.requires_grad]  # a float output made of data alone owes no gradient
            roots, grads = [out for out, _ in kept], [g for _, g in kept]
        queue = self._wgrad.setdefault(unit, []) if kind is Kind.B else None  # the W op drains it
        if not roots:
            return
        if kind is Kind.BW:
            torch.autograd.backward(roots, grads)
            return
        chunk = unit[:2]
        split = Split(roots, grads, [t for t in floating(x) if t.requires_grad], self._chunk_params[chunk])
        hidden = split.hidden()
        with WeightGradStore.deferring(queue):  # our linears queue their weight GEMMs for W themselves
            weight = split.backward_input()
        if weight is not None:
            queue.append(weight)
            self.weights_in_w += len(split.w_params)
        self._say_whole(chunk, split, Split.hidden_changed(hidden))

    def _say_whole(self, chunk, split, hidden):
        """The log line, once per chunk and cause, of a backward that B ran whole."""
        causes = sorted(split.whole) + (["a backward autograd cannot see into"] if hidden and not split.reentrant
                                        else [])
        for cause in causes:
            if (chunk, cause) not in self._said:
                self._said.add((chunk, cause))
                print(f"megatron_ds: rank {self.global_rank} chunk {chunk}: {cause} computes input and weight "
                      f"gradients in one backward; its parameters' gradients come in B, whole (no W split)",
                      flush=True)

    # -- evaluation ------------------------------------------------------------------------------
    def eval_batch(self, data_iter, return_logits=False, compute_loss=True, reduce_output="avg", bcast_loss=True,
                   num_micro_batches=None):
        """DeepSpeed's: the mean loss, on every rank; with reduce_output=None the micro-batches' losses, with
        compute_loss=False the model's outputs (reduced as the losses), with return_logits also the last
        micro-batch's outputs, these three on the rank that holds the loss stage (None elsewhere)."""
        if self.plan.schedule.replicas > 1 and (return_logits or not compute_loss or reduce_output != "avg"):
            raise ConfigError(f"schedule {self.plan.settings.schedule!r} runs two pipelines whose last stages sit on "
                              "two ranks: eval_batch returns the mean loss only")
        self._computes_loss, self._outputs = compute_loss, {}
        self.module.eval()
        train_iterator = self.data_iterator
        self.set_dataiterator(data_iter)
        micro_batches = num_micro_batches or self.micro_batches
        try:
            with torch.no_grad():
                self._exec_schedule(self._inference_schedule(micro_batches))
                mean = self._aggregate_total_loss() if compute_loss and reduce_output == "avg" else None
        finally:
            self.set_dataiterator(train_iterator)
            self.module.train()
            outputs, self._outputs, self._computes_loss = self._outputs, None, True
        if mean is not None and not return_logits:
            return mean
        result = logits = None
        if self._last:
            ordered = [outputs[mb] for mb in sorted(outputs)]
            logits = ordered[-1][1]
            result = mean if mean is not None else ds.reduce_outputs(
                self, [loss for loss, _ in ordered], reduce=reduce_output, micro_batches=micro_batches)
        return (result, logits) if return_logits else result

