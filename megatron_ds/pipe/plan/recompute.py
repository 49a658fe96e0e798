"""Whole-layer recompute in the chunked module: Megatron's --recompute-method uniform and block, per chunk.

DeepSpeed's PipelineModule checkpoints every `activation_checkpoint_interval` consecutive pipeline layers,
counted from the stage's first, embedding and head included: a group that holds one of them is not
checkpointed, so the first stage's groups are off by the embedding, and there is no block method. Megatron
counts transformer layers only, per virtual stage: uniform recomputes them in groups of N from the chunk's
first, block the first N of the chunk one by one and keeps the rest. The chunked module runs its chunks'
layers in those groups (schedules/recompute.checkpoint_groups), each checkpointed group through the module's
checkpoint function (DeepSpeed's, as for the interval), so what a schedule sees of a recomputed chunk is what
it saw before: a forward that keeps less and a backward that runs the group's forward again first.

DeepSpeed's own engine keeps DeepSpeed's PipelineModule unchanged: it takes uniform with N = 1 (its interval
1 is Megatron's) and refuses the rest at start-up (`stock_problem`).
"""
from megatron_ds.schedules.recompute import Recompute, checkpoint_groups

from .config import ConfigError

TRANSFORMER = "TransformerLayer"


def stock_problem(recompute: Recompute):
    """Why DeepSpeed's own engine cannot run `recompute` (None: it can, as its activation_checkpoint_interval)."""
    if not recompute.full or (recompute.method in (None, "uniform") and recompute.n == 1):
        return None
    how = "block" if recompute.method == "block" else f"uniform with --recompute-num-layers {recompute.n}"
    return (f"--recompute-method {how} with DeepSpeed's own engine (no \"pipeline.schedule\"): its "
            "activation_checkpoint_interval groups pipeline layers from the stage's first, the embedding and "
            "head included, and has no block method; run a named schedule (\"schedule\": \"1f1b\" is its order "
            "on our engine), or --checkpoint-activations --checkpoint-num-layers N for DeepSpeed's grouping")


def interval(recompute: Recompute, given: int) -> int:
    """DeepSpeed's activation_checkpoint_interval for a module that recomputes by `recompute`: positive whenever
    layers are checkpointed (the engine then makes the first stage's inputs require grad, as DeepSpeed's
    reentrant checkpoint needs), `given` otherwise."""
    return max(given, recompute.n if recompute.method != "block" else 1) if recompute.full else given


def chunk_groups(recompute: Recompute, funcs) -> list:
    """A chunk's forward functions as checkpoint_groups' (start, stop, checkpointed) runs."""
    return checkpoint_groups(recompute, [type(f).__name__ == TRANSFORMER for f in funcs])


def forward_in_groups(module, groups, inputs):
    """DeepSpeed's PipelineModule.forward over explicit groups of the active chunk's forward functions."""
    module.micro_offset += 1  # DeepSpeed's per-forward count (its per-layer seeds)
    x = inputs
    for start, stop, checkpointed in groups:
        run = _run(module, start, stop)
        x = module.activation_checkpoint_func(run, *(x if isinstance(x, tuple) else (x,))) if checkpointed else run(x)
    return x


def _run(module, start, stop):
    funcs = module.forward_funcs[start:stop]

    def run(*inputs):
        x = inputs[0] if len(inputs) == 1 else inputs  # DeepSpeed's checkpoint hands a single tensor unwrapped
        for f in funcs:
            x = f(x)
        return x
    return run


def checked(config) -> Recompute:
    """The Recompute of a GPTConfig, its combination checked (Megatron's rules)."""
    recompute = Recompute.of(config)
    problem = recompute.problem()
    if problem:
        raise ConfigError(problem)
    return recompute
