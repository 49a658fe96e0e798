"""NaN and inf: an iteration whose loss or gradient is not finite is skipped, counted, and a run of them stops.

Megatron logs "number of nan iterations" and, with --check-for-nan-in-loss-and-grad, raises on the first
one. Here the step is skipped instead and the run goes on; --exit-after-nan-iterations N in a row save
the (untouched) weights and stop the run with exit code 3 and one message.

Who skips the step (measured with DeepSpeed 0.19.8, an inf injected into one gradient of rank 0 at PP=2):
DeepSpeed's ZeRO optimizer (stage 1, our default) checks the gradients' global norm before stepping and
skips on inf/NaN in bf16 (`bf16.check_grad_overflow`, true by default) and fp32 (an invalid norm counts
as an overflow), and so does its BF16_Optimizer (bf16 without ZeRO); the engine then counts the step in
`skipped_steps` and does not step the lr schedule. In fp32 without ZeRO (DeepSpeed's stock engine, stage
0) nothing checks: the engine clips and steps the torch optimizer. `guard_step` wraps that step: a
non-finite gradient on any rank (an all-reduce MAX over all ranks) makes every rank skip, and DeepSpeed
reads `optimizer.overflow` as it does from ZeRO. fp16 keeps DeepSpeed's loss scaler: an overflow there
is a skipped iteration, not a NaN one, unless the loss itself is not finite.

`--inject-inf-grad-iterations` puts an inf into one gradient of rank 0 at the given iterations: the
fault-injection script and the tests use it to show the skip.
"""
import math

EXIT_CODE = 3


def add_nonfinite_args(parser):
    g = parser.add_argument_group("non-finite numbers")
    g.add_argument("--exit-after-nan-iterations", type=int, default=10, metavar="N",
                   help="save and stop (exit code 3) after N iterations in a row whose loss or gradient was "
                        "NaN or inf; each one is skipped and counted (0: never stop)")
    g.add_argument("--inject-inf-grad-iterations", type=int, nargs="+", default=None, metavar="ITER",
                   help="fault injection: an inf in one gradient of rank 0 at these iterations")


class NonFiniteStop(RuntimeError):
    """Too many NaN/inf iterations in a row; the checkpoint is saved."""


class NanGuard:
    """Counts NaN/inf iterations in a row; `iteration` is the one train_batch is running."""

    def __init__(self, args, engine, iteration):
        self.limit, self.fp16, self.in_a_row, self.iteration = args.exit_after_nan_iterations, args.fp16, 0, iteration
        if not hasattr(engine.optimizer, "overflow"):
            guard_step(engine.optimizer)
        if args.inject_inf_grad_iterations:
            inject_inf_grad(engine, set(args.inject_inf_grad_iterations), iteration)

    def observe(self, loss, grad_norm, skipped):
        """True when this iteration's loss or gradient was NaN or inf (outside fp16, only that skips a step)."""
        bad_grad = skipped or (grad_norm is not None and not math.isfinite(grad_norm))
        bad = not math.isfinite(loss) or (not self.fp16 and bool(bad_grad))
        self.in_a_row = self.in_a_row + 1 if bad else 0
        return bad

    def stop_reason(self):
        if self.limit and self.in_a_row >= self.limit:
            return (f"stopping at iteration {self.iteration() - 1}: {self.in_a_row} iterations in a row had a NaN or "
                    f"inf loss or gradient (--exit-after-nan-iterations {self.limit}); each step was skipped, the "
                    "weights saved are those before them. Lower the learning rate or check the data.")
        return None


def guard_step(optimizer):
    """Skip the step of a plain optimizer when any rank's gradient is not finite (DeepSpeed reads `overflow`)."""
    import torch
    import torch.distributed as dist
    step = optimizer.step

    def checked_step(*args, **kwargs):
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        bad = torch.tensor([0.0 if all(torch.isfinite(g).all() for g in grads) else 1.0],
                           device=grads[0].device if grads else "cpu")
        if dist.is_initialized():
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        optimizer.overflow = bool(bad.item())
        if optimizer.overflow:
            optimizer.zero_grad(set_to_none=True)
            return None
        return step(*args, **kwargs)

    optimizer.overflow = False
    optimizer.step = checked_step


def inject_inf_grad(engine, iterations, iteration):
    import torch.distributed as dist
    if dist.get_rank() != 0:
        return
    param = next(p for p in engine.module.parameters() if p.requires_grad)

    def poison(grad):
        if iteration() in iterations:
            grad = grad.clone()
            grad.view(-1)[0] = float("inf")
        return grad

    param.register_hook(poison)
