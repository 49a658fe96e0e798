"""Overlapped units: the forward of one micro-batch and the backward of another run as one unit, each
side's expert-parallel all-to-all in flight while the other side computes.

The backward side runs on a second thread (one per engine, kept between units), the forward side on the
caller's; a baton lets exactly one of them run at a time. A side that issues an all-to-all
(model/moe_dispatch.InFlight.meanwhile) hands the baton to the other side, if that one still runs, and waits on
its collective when the baton comes back. The hand-overs fall at the same points of the same ops on every rank
of an expert-parallel group (data-parallel ranks of one stage, running the same op list), so every rank issues
its collectives in the same order and none waits for a peer that waits for it; and each side runs its own op's
computations in their own order, so the results are bit for bit those of the two ops one after the other. A
layer without an all-to-all never hands over: the unit is then its two ops in sequence.

What an op holds in process-wide state while it runs is each side's own, swapped at every hand-over
(`side_state`): the open micro-batch's packed documents (model/documents.Documents: a forward's next layer and a
backward's recomputation read them), the module's active chunk (DeepSpeed's activation checkpoint recomputes
through its forward functions) and the RNG states (CPU, accelerator and the tensor-parallel tracker's: a
recomputation in the backward sets its forward's, the forward side draws its dropout masks from its own).
Swapped, not thread-local: on a GPU autograd runs the backward side's functions on its device thread. The
forward side's state is the one left when the unit ends (a backward leaves the RNG as it found it: the plain
order's end). Checked and left shared, since one side alone touches it: the B op's queue of deferred weight
GEMMs (model/linear.WeightGradStore: backward passes), DeepSpeed's `_running_engine_backward` (set by the
backward side, read by backward hooks), the router's loss log and expert counts (added to by backward passes,
in their plain order); grad mode is per thread (the second thread takes the caller's); Seq1F1B's open segment
never meets a unit (no overlapped order has segments; pipe/plan/config.py refuses a schedule file with both).
"""
import queue
import threading

import torch
from deepspeed.accelerator import get_accelerator

from megatron_ds.model.documents import Documents
from megatron_ds.model.moe_dispatch import InFlight
from megatron_ds.model.tensor_parallel import get_rng_tracker

FORWARD, BACKWARD = 0, 1  # the sides: the caller's thread, the second thread


class Baton:
    """Two sides, one running at a time; `capture()` and `restore(state)` swap what each holds in process-wide
    state at every hand-over. Both start from the state of the moment."""

    def __init__(self, capture, restore, first):
        self._capture, self._restore = capture, restore
        self._cond = threading.Condition()
        self._saved = [capture()] * 2
        self._running = [True, True]
        self.holder = first

    def hand_over(self):
        """The holder's all-to-all is in flight: the other side runs until it hands back or ends."""
        with self._cond:
            me = self.holder
            if self._running[1 - me]:
                self._pass(me, 1 - me)
                self._cond.wait_for(lambda: self.holder == me)

    def wait_turn(self, side):
        with self._cond:
            self._cond.wait_for(lambda: self.holder == side)

    def finish(self, side):
        """`side` has ended: the other runs on alone; the forward side holds the baton and its state at the end."""
        with self._cond:
            self._running[side] = False
            if self._running[1 - side] or side == BACKWARD:
                self._pass(side, 1 - side)

    def wait_done(self):
        with self._cond:
            self._cond.wait_for(lambda: not any(self._running) and self.holder == FORWARD)

    def _pass(self, me, other):
        self._saved[me] = self._capture()
        self._restore(self._saved[other])
        self.holder = other
        self._cond.notify_all()


class OverlapRunner:
    """Runs units: the forward side on the caller's thread, the backward side on one kept thread."""

    def __init__(self, capture, restore, device=None):
        self._capture, self._restore, self._device = capture, restore, device
        self._jobs, self._thread = queue.SimpleQueue(), None

    def run(self, forward, backward, backward_first):
        """forward()'s result, once backward() has run too; the side of the unit's first op starts."""
        baton = Baton(self._capture, self._restore, BACKWARD if backward_first else FORWARD)
        errors, grad = [], torch.is_grad_enabled()

        def backward_side():
            baton.wait_turn(BACKWARD)
            try:
                with torch.set_grad_enabled(grad):
                    backward()
            except BaseException as exc:  # noqa: BLE001 - raised again on the caller's thread
                errors.append(exc)
            finally:
                baton.finish(BACKWARD)

        self._submit(backward_side)
        InFlight.meanwhile, out = baton.hand_over, None
        try:
            baton.wait_turn(FORWARD)
            try:
                out = forward()
            except BaseException as exc:  # noqa: BLE001 - the backward side ends first, then it is raised
                errors.insert(0, exc)
            baton.finish(FORWARD)
            baton.wait_done()
        finally:
            InFlight.meanwhile = None
        if errors:
            raise errors[0]
        return out

    def _submit(self, job):
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="overlapped-backward", daemon=True)
            self._thread.start()
        self._jobs.put(job)

    def _serve(self):
        if self._device is not None and torch.device(self._device).type == "cuda":
            torch.cuda.set_device(self._device)  # the current device is per thread
        while True:
            self._jobs.get()()


def side_state(module):
    """(capture, restore) of what one op of a unit holds in process-wide state (the module docstring's list)."""
    accelerator, tracker = get_accelerator(), get_rng_tracker()

    def capture():
        return (Documents.current(), module.active_chunk, torch.get_rng_state(), accelerator.get_rng_state(),
                tracker.get_states())

    def restore(state):
        documents, chunk, cpu_rng, accelerator_rng, tracker_rng = state
        Documents.make_current(documents)  # its masking/positioning flags follow it
        if module.active_chunk != chunk:
            module.activate(chunk)
        torch.set_rng_state(cpu_rng)
        accelerator.set_rng_state(accelerator_rng)
        tracker.set_states(tracker_rng)
    return capture, restore
