"""Megatron's AnnealingLR: linear warm-up, then linear/cosine/constant decay to min_lr.

Steps are counted in samples (each optimizer step adds the global batch size),
so iteration-based flags are converted with the global batch and sample-based
ones are used as they are; batch-size ramp-up then moves the schedule by the
samples actually consumed. DeepSpeed calls step() after every optimizer step
and keeps state_dict() in its checkpoints.
"""
import math

from megatron_ds.data.dist_utils import print_rank_0


class AnnealingLR:

    def __init__(self, optimizer, max_lr, min_lr, warmup_steps, decay_steps, decay_style,
                 global_batch_size, use_checkpoint_lr_scheduler=False, override_lr_scheduler=False):
        if decay_style not in ("linear", "cosine", "constant"):
            raise ValueError(f"unknown lr decay style {decay_style!r}")
        if decay_steps <= 0 and decay_style != "constant":
            raise ValueError(f"lr decay steps must be positive, got {decay_steps}")
        self.optimizer = optimizer
        self.max_lr, self.min_lr = float(max_lr), float(min_lr)
        self.warmup_steps, self.decay_steps = int(warmup_steps), int(decay_steps)
        self.decay_style = decay_style
        self.global_batch_size = global_batch_size  # the increment of the next step; the loop updates it
        self.use_checkpoint_lr_scheduler = use_checkpoint_lr_scheduler
        self.override_lr_scheduler = override_lr_scheduler
        self.num_steps = 0
        self.step(0)

    def get_lr(self):
        """The learning rate after num_steps samples (Megatron's formula)."""
        if self.warmup_steps > 0 and self.num_steps <= self.warmup_steps:
            return self.max_lr * self.num_steps / self.warmup_steps
        if self.decay_style == "constant":
            return self.max_lr
        if self.num_steps > self.decay_steps:
            return self.min_lr
        ratio = (self.num_steps - self.warmup_steps) / (self.decay_steps - self.warmup_steps)
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def step(self, increment=None):
        self.num_steps += self.global_batch_size if increment is None else increment
        lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
        return lr

    def get_last_lr(self):
        return [g["lr"] for g in self.optimizer.param_groups]

    def state_dict(self):
        return {"max_lr": self.max_lr, "warmup_steps": self.warmup_steps, "num_steps": self.num_steps,
                "decay_style": self.decay_style, "decay_steps": self.decay_steps, "min_lr": self.min_lr}

    def _check_and_set(self, name, current, saved):
        if self.override_lr_scheduler:
            return current
        if not self.use_checkpoint_lr_scheduler and current != saved:
            what = "using the checkpoint's"
            if name == "decay_steps" and saved < current:  # a resume with a longer --train-iters
                what += (f": the lr reaches min_lr {self.min_lr:g} at sample {saved} and stays there for the rest "
                         f"of the run")
            print_rank_0(f"WARNING: lr scheduler {name}: the flags say {current}, the checkpoint {saved}; {what} "
                         "(pass --override-lr-scheduler to use the flags)")
        return saved

    def load_state_dict(self, state):
        self.max_lr = self._check_and_set("max_lr", self.max_lr, state["max_lr"])
        self.min_lr = self._check_and_set("min_lr", self.min_lr, state["min_lr"])
        self.warmup_steps = self._check_and_set("warmup_steps", self.warmup_steps, state["warmup_steps"])
        self.decay_steps = self._check_and_set("decay_steps", self.decay_steps, state["decay_steps"])
        self.decay_style = self._check_and_set("decay_style", self.decay_style, state["decay_style"])
        self.num_steps = 0
        self.step(increment=state["num_steps"])
