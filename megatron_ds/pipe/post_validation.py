"""Optimizer post-validation (Zero Bubble PP, Sec. 4) for DeepSpeed's ZeRO-1 optimizer under a pipeline.

`"pipeline": {"post_validation": true}` replaces the step of the engine's DeepSpeedZeroOptimizer: ScheduleEngine's
`_take_model_step` runs DeepSpeed's own with `PostValidation.optimizer()` in the optimizer's place, a view of the
ZeRO optimizer whose `step` is this module's (the optimizer object itself is left as DeepSpeed built it).

DeepSpeed's step (stage_1_and_2.py, `step`) opens with collectives over the data-parallel group and then
the model-parallel group, which is the whole pipeline: the inf/nan flag and the squared gradient norm of
every param group. No rank can touch its weights before the slowest stage has finished its last backward,
and then train_batch reduces the loss over the pipeline once more. Here each rank instead

1. computes its local squared norms and inf/nan flag exactly as DeepSpeed does, sums them over its
   data-parallel peers (the same stage of the other replicas, which finish together) and launches the
   pipeline-wide sum asynchronously, with its loss sum in the same message (so train_batch's loss needs no
   second pipeline collective: `take_pipe_loss`);
2. steps optimistically, unclipped, after copying its fp32 master partition, optimizer state and loss
   scaler into buffers kept from step to step (and its gradients, unless the step only reads them).
   It steps once, after the check, in DeepSpeed's order when that cannot pay: when its own gradients
   already show a clip or an overflow, when the check has already arrived, or when the check has lately
   arrived sooner than the copy takes (a rank that usually finishes last learns that; see `_early`);
3. waits for the sum (the end of the optimizer step: the only wait) and validates with DeepSpeed's own
   formulas: if DeepSpeed would have clipped, it restores the copy and redoes the step with DeepSpeed's clip
   coefficient; if it would have found inf/nan, it restores and skips (loss scale update included). Then
   the data-parallel all-gather of the updated partitions, once.

What overlaps the wait: this rank's optimistic step (gradient flattening, unscale, optimizer math, the
bf16 copy) runs while the slower stages finish their last ops. The pipeline-wide wait is not moved into the
next iteration: its first forward on every rank needs this rank's weights, and train_batch returns the loss.

The engine sees a finished step: `optimizer.overflow` and `_global_grad_norm` are DeepSpeed's values, so
DeepSpeed's `_take_model_step` counts skipped steps and steps the lr scheduler as it always does, and
`engine.get_global_grad_norm()` is DeepSpeed's value. The rollback is exact (kept copies, not an inverted
update), so a redone step equals DeepSpeed's bit for bit. The sums are DeepSpeed's sums for groups of two
ranks; a larger group may add the few numbers of this message in another order than DeepSpeed's
one-number collectives (a difference in the last bit of the norm).

fp16: the dynamic loss scale goes through the ZeRO optimizer's own `_update_scale`, in DeepSpeed's order
(the scale is updated before the unscale, and the reported norm is divided by the scale before the
update). The optimistic step assumes no overflow; the scaler's state is kept with the copy and restored
before `_update_scale(True)` when the check finds one. DeepSpeed refuses fp16 on a CPU only because the
accelerator says so; the tests patch that answer and run ZeRO-1 fp16 with a moving scale.

The timing rule of `_early` reads host clocks: right for CPU ranks; on a GPU, host time does not see the
queued copies and optimizer kernels, so it leans towards stepping early.
"""
import time

import torch
import torch.distributed as dist
from deepspeed.comm import pg_utils
from deepspeed.runtime.constants import PIPE_REPLICATED
from deepspeed.runtime.utils import (combine_grad_norm_groups, is_invalid_grad_norm, is_model_parallel_parameter,
                                     mask_nan_or_inf_with_val_inplace)
from deepspeed.runtime.zero import stage_1_and_2 as zero
from deepspeed.runtime.zero.utils import get_norm_dtype

from .plan.config import ConfigError
from .deepspeed.zero_internals import ZeroInternals

NORM_TYPE = 2.0
# Optimizers whose step (single-tensor and foreach forms) reads the gradients and never writes them.
GRAD_READ_ONLY = (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD)


class StepView:
    """The ZeRO optimizer as DeepSpeed's `_take_model_step` sees it under post-validation: every
    attribute is the optimizer's (read through), `step` is post-validation's."""

    def __init__(self, post_validation):
        self._post_validation = post_validation

    def step(self, closure=None):
        return self._post_validation.step(closure)

    def __getattr__(self, name):
        return getattr(self._post_validation.opt, name)


class PostValidation:
    """The step that stands in for the ZeRO optimizer's (through `optimizer()`, see ScheduleEngine's
    `_take_model_step`); `counts` says which path each step took.
    `loss_sum()` is this rank's loss sum of the iteration, sent with the check."""

    def __init__(self, engine, loss_sum):
        opt = engine.optimizer
        _check_supported(opt)
        self.engine, self.opt, self.zero, self.loss_sum = engine, opt, ZeroInternals(opt), loss_sum
        self.groups = len(opt.bit16_groups)
        self.dp_group = opt.dp_process_group if pg_utils.is_parallel(opt.dp_process_group) else None
        self.mp_group = opt.model_parallel_group if pg_utils.is_parallel(opt.model_parallel_group) else None
        pipe = engine.grid.get_pipe_parallel_group() if engine.is_pipe_parallel else None
        self.fold_loss = (self.mp_group is not None and pipe is not None
                          and dist.get_process_group_ranks(self.mp_group) == dist.get_process_group_ranks(pipe))
        self._pipe_loss = None
        # Step early only when it can pay (see _early). False: always early (tests of the rollback).
        self.shortcuts = True
        self._arrival = self._copy = None  # seconds: launch to check, keeping the copy (running averages)
        self._spare = None  # the kept copy's buffers, reused every step
        self.counts = {"steps": 0, "optimistic": 0, "redone": 0, "rolled_back_skipped": 0, "skipped": 0}

    def optimizer(self):
        """What DeepSpeed's step bookkeeping reads as `engine.optimizer` while this step runs."""
        return StepView(self)

    # -- the step ----------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        opt = self.opt
        opt.micro_step_id = zero.INITIAL_MICRO_STEP_ID
        if not opt.compute_grad_norm:
            self.zero.set_global_grad_norm(None)
        self.counts["steps"] += 1

        sums = self._local_sums()
        if self.dp_group is not None:
            dist.all_reduce(sums, group=self.dp_group)
        # A new tensor: the collective writes into it while this rank goes on reading `sums`.
        message = torch.cat([sums, self.loss_sum().reshape(1).float()] if self.fold_loss else [sums])
        launched = time.perf_counter()
        work = dist.all_reduce(message, group=self.mp_group, async_op=True) if self.mp_group is not None else None

        grads = [self._take_grads(i) for i in range(self.groups)]
        prev_scale = opt.loss_scale
        kept = None
        if self._early(work, sums, prev_scale, time.perf_counter() - launched):
            kept = self._keep(grads)
            kept_at = time.perf_counter()
            arrived_during_copy = work.is_completed()
            self.zero.update_scale(False)
            for i, g in enumerate(grads):
                self._apply(i, g, None)
            self.counts["optimistic"] += 1
            work.wait()
            # When the check arrived, as far as this rank can tell (an upper bound if it came early).
            self._learn(kept_at - launched if arrived_during_copy else time.perf_counter() - launched)
        elif work is not None:
            work.wait()
            self._learn(time.perf_counter() - launched)
        if self.fold_loss:
            self._pipe_loss = message[-1].clone()
        overflow, norm = self._verdict(message)

        if kept is None:  # DeepSpeed's own order, with the global values in hand
            self.zero.update_scale(overflow)
            if not overflow:
                for i, g in enumerate(grads):
                    self._apply(i, g, norm)
        elif overflow:
            self._restore(kept)
            self.zero.update_scale(True)
            self.counts["rolled_back_skipped"] += 1
        elif self._clips(norm):
            self._restore(kept, scaler=False)
            for i, g in enumerate(kept["grads"]):
                self._apply(i, g, norm)
            self.counts["redone"] += 1

        opt.overflow = overflow
        if overflow:
            self._skip()
            return
        self.zero.commit_muon_momentum()
        if norm is not None:
            self.zero.set_global_grad_norm(norm / prev_scale)
        zero.all_gather_dp_groups(groups_flat=opt.bit16_groups_flat,
                                  partitioned_param_groups=opt.parallel_partitioned_bit16_groups,
                                  dp_process_group=opt.real_dp_process_group,
                                  start_alignment_factor=opt.nccl_start_alignment_factor,
                                  allgather_bucket_size=opt.allgather_bucket_size)
        for i in range(self.groups):
            self.zero.update_model_bit16_weights(i)

    def _early(self, work, sums, scale, ready):
        """Step before the check arrives? `ready`: seconds from the launch to now (gradients flattened).

        Stepping early pays when the check arrives later than this rank can have its copy kept: it
        then finishes at max(ready + copy + step, arrival) instead of arrival + step. A rank that is
        usually the last to finish (its check arrives at once) learns that and steps once, after the
        check, paying no copy. It still measures the arrival then, so it goes back to stepping early
        when that changes."""
        if work is None or 0.0 < self.opt.clip_grad < 1e-6:  # see _unclipped_norm
            return False
        if not self.shortcuts:
            return True
        if work.is_completed() or not self._locally_valid(sums, scale):
            return False
        return self._arrival is None or self._copy is None or self._arrival > ready + self._copy

    def _learn(self, arrival):
        self._arrival = arrival if self._arrival is None else 0.5 * (self._arrival + arrival)

    def take_pipe_loss(self):
        """The pipeline-wide loss sum that came with this step's check (once), else None."""
        loss, self._pipe_loss = self._pipe_loss, None
        return loss

    # -- DeepSpeed's arithmetic, split where the wait goes ---------------------------------------
    def _local_sums(self):
        """[squared grad norm of each param group..., inf/nan flag] of this rank's partition (float32),
        as get_grad_norm_direct and has_overflow_partitioned_grads_serial compute them before reducing."""
        opt = self.opt
        sums = [self._local_square_norm(opt.averaged_gradients[i], opt.params_in_partition[i])
                for i in range(self.groups)]
        flag = opt.has_overflow_partitioned_grads_serial().float().reshape(())
        return torch.stack([*sums, flag.to(sums[0].device)]).float()

    def _local_square_norm(self, gradients, params):
        opt = self.opt
        norms = []
        grads = (g for g in gradients if not ZeroInternals.is_padding(g))
        for g, p in zip(grads, params):
            if hasattr(p, PIPE_REPLICATED) and p.ds_pipe_replicated:
                continue
            if is_model_parallel_parameter(p) or opt.model_parallel_rank == 0:
                norms.append(torch.linalg.vector_norm(g.data.to(get_norm_dtype()).detach(), ord=NORM_TYPE)
                             .to(opt.device))
        if not norms:
            return torch.tensor(0.0, dtype=torch.float32).to(opt.device)
        return torch.stack(norms).pow(NORM_TYPE).sum().float()

    def _verdict(self, message):
        """(overflow, scaled global norm or None) from the reduced message, as DeepSpeed's step decides."""
        opt = self.opt
        overflow = bool(message[self.groups] > 0) if opt.check_grad_overflow else False
        norm = None
        if opt.compute_grad_norm and not overflow:
            norm_groups = []
            for i in range(self.groups):
                total = message[i].clone().pow(1. / NORM_TYPE)
                mask_nan_or_inf_with_val_inplace(total, device=opt.device)
                norm_groups.append(total)
            norm = combine_grad_norm_groups(norm_groups, norm_type=NORM_TYPE)
            if (opt.dtype != torch.bfloat16 or opt.check_grad_overflow) and is_invalid_grad_norm(norm):
                overflow = True
        return overflow, norm

    def _take_grads(self, i):
        """Group i's flat fp32 gradient partition; frees the parameters' gradients (as DeepSpeed's step)."""
        opt = self.opt
        dp_group = opt.real_dp_process_group[i]
        opt.free_grad_in_param_list(opt.params_not_in_partition[i])
        flat = self.zero.preflattened_grad_partition(i)
        if flat is None:
            if dist.get_rank(group=dp_group) == dist.get_world_size(group=dp_group) - 1:
                flat = opt.flatten_dense_tensors_aligned(opt.averaged_gradients[i], int(opt.partition_size[i]))
            else:
                flat = opt.flatten(opt.averaged_gradients[i])
        grad = flat.to(opt.single_partition_of_fp32_groups[i].dtype)
        assert grad.numel() == opt.partition_size[i], (grad.numel(), opt.partition_size[i])
        opt.free_grad_in_param_list(opt.params_in_partition[i])
        self.zero.release_preflattened_grad_buffers(i)
        opt.averaged_gradients[i] = None
        opt.all_grad_tensors[i] = None
        return grad

    def _apply(self, i, grad, norm):
        """Unscale/clip with `norm` (None: coefficient 1), step group i, copy it into the model's partition."""
        opt = self.opt
        fp32 = opt.single_partition_of_fp32_groups[i]
        fp32.grad = grad
        opt.unscale_and_clip_grads([grad], norm if norm is not None else self._unclipped_norm())
        self.zero.optimizer_step(i)
        fp32.grad = None
        opt.parallel_partitioned_bit16_groups[i][self._partition_id(i)].data.copy_(fp32.data)

    def _unclipped_norm(self):
        # unscale_and_clip_grads clamps its coefficient at 1: a zero norm gives exactly 1 whenever
        # clip_grad >= 1e-6 (smaller ones never step early), DeepSpeed's coefficient for a step it does not clip.
        return torch.zeros((), dtype=torch.float32, device=self.opt.device)

    def _clips(self, norm):
        """Whether DeepSpeed's unscale_and_clip_grads would use a coefficient above 1 for this norm."""
        opt = self.opt
        if opt.clip_grad <= 0.0 or norm is None:
            return False
        if is_invalid_grad_norm(norm):
            return True
        clip = ((norm / opt.loss_scale) + 1e-6) / opt.clip_grad
        return bool(torch.clamp(clip, min=1.0) > 1.0)

    def _locally_valid(self, sums, scale):
        """False when this rank's own gradients already show the step will be clipped or skipped."""
        opt = self.opt
        if opt.check_grad_overflow and sums[self.groups] > 0:
            return False
        if opt.compute_grad_norm:
            local = sums[:self.groups].double().sum().sqrt()
            if not torch.isfinite(local):
                return False
            if opt.clip_grad > 0.0 and ((local / scale) + 1e-6) / opt.clip_grad > 1.0:
                return False
        return True

    def _skip(self):
        """DeepSpeed's step after an overflow."""
        opt = self.opt
        if opt.compute_grad_norm:
            self.zero.set_global_grad_norm(float("inf"))
        opt.zero_grad(set_to_none=True)
        self.zero.release_preflattened_grad_buffers()
        for k in opt.averaged_gradients.keys():
            opt.averaged_gradients[k] = None
            opt.all_grad_tensors[k] = None
        self.counts["skipped"] += 1

    # -- the kept copy -------------------------------------------------------------------------------
    def _keep(self, grads):
        """Copy the masters, optimizer state and loss scaler (into buffers kept from step to step), and
        the gradients where the step could change them and a clipped redo may need them."""
        opt = self.opt
        start = time.perf_counter()
        masters = opt.single_partition_of_fp32_groups
        if self._spare is None:
            self._spare = {"master": [torch.empty_like(p) for p in masters], "state": [{} for _ in masters]}
        states = []
        for i, p in enumerate(masters):
            self._spare["master"][i].copy_(p.detach())
            state = opt.optimizer.state.get(p)
            if not state:
                states.append(None)
                continue
            spare = self._spare["state"][i]
            kept = {}
            for key, value in state.items():
                if torch.is_tensor(value):
                    buf = spare.get(key)
                    if buf is None or buf.shape != value.shape or buf.dtype != value.dtype:
                        buf = spare[key] = torch.empty_like(value)
                    value = buf.copy_(value)
                kept[key] = value
            states.append(kept)
        if opt.clip_grad <= 0.0:
            kept_grads = None
        elif (not opt.loss_scaler.dynamic and opt.loss_scale == 1.0 and type(opt.optimizer) in GRAD_READ_ONLY
              and not any(g.get("fused") for g in opt.optimizer.param_groups)):
            kept_grads = grads  # the unclipped step multiplies them by exactly 1 and the optimizer only reads
        else:
            kept_grads = [g.clone() for g in grads]
        seconds = time.perf_counter() - start
        self._copy = seconds if self._copy is None else 0.5 * (self._copy + seconds)
        return {"master": self._spare["master"], "state": states, "grads": kept_grads,
                "scaler": dict(vars(opt.loss_scaler))}

    def _restore(self, kept, scaler=True):
        opt = self.opt
        relink = False
        for i, p in enumerate(opt.single_partition_of_fp32_groups):
            p.data.copy_(kept["master"][i])
            saved = kept["state"][i]
            if saved is None:
                opt.optimizer.state.pop(p, None)
                relink = True
            else:
                state = opt.optimizer.state[p]
                for key in [k for k in state if k not in saved]:
                    del state[key]
                for key, value in saved.items():
                    current = state.get(key)
                    if torch.is_tensor(value) and torch.is_tensor(current) and current.shape == value.shape:
                        current.copy_(value)  # in place: DeepSpeed's hp mappings view these tensors
                    elif torch.is_tensor(value):
                        state[key] = value.clone()  # not the spare buffer itself
                        relink = True
                    else:
                        state[key] = value
            # The model's partition is always the master's copy (DeepSpeed copies it after every step).
            opt.parallel_partitioned_bit16_groups[i][self._partition_id(i)].data.copy_(p.data)
        if relink:  # the next _optimizer_step links DeepSpeed's hp mappings to the new state, as on a first step
            self.zero.relink_hp_optimizer_states()
        if scaler:
            vars(opt.loss_scaler).update(kept["scaler"])

    def _partition_id(self, i):
        return dist.get_rank(group=self.opt.real_dp_process_group[i])


def _check_supported(opt):
    name = type(opt).__name__
    if not isinstance(opt, zero.DeepSpeedZeroOptimizer) or opt.partition_gradients:
        raise ConfigError(f'ds_config "pipeline.post_validation" = true works with ZeRO stage 1 '
                          f'(DeepSpeedZeroOptimizer); this engine\'s optimizer is {name} (bf16 with '
                          f'"grad_accum_dtype": "fp32" selects BF16_Optimizer: drop that key)')
    unsupported = {"optimizer offload": opt.cpu_offload, "ZenFlow": opt.zenflow, "MoE": opt.has_moe_layers,
                   "torch autocast": opt.torch_autocast_gradscaler is not None,
                   "Muon": any(g.get("use_muon", False) for g in opt.optimizer.param_groups)}
    on = [k for k, v in unsupported.items() if v]
    if on:
        raise ConfigError(f'ds_config "pipeline.post_validation" = true does not support {", ".join(on)}')
