"""A rank that runs out of memory says where and what lowers it, in one line, and exits at once.

MemoryError (the CPU allocator) or torch.OutOfMemoryError (CUDA) on one rank: it prints its rank, its
pipeline stage, the op it was running (F, B, W or BW with its micro-batch, from the engine's tracer), the
iteration and the peak memory of the process, with the knobs that lower the peak and their values in
this run, then exits with code 4 without saving (the last good checkpoint stays as it is; a save now
would hold a half-done step). The other ranks find it gone at their next collective or p2p call and
exit with code 1 too, naming the call (timeouts.py), well within --distributed-timeout-minutes.

--inject-oom RANK ITER [MB] (fault injection): the allocator of rank RANK fails in the forward op of
micro-batch MB (default 1) at iteration ITER (our engine's schedules).
"""
import os
import sys

from megatron_ds.errors import print_error
from megatron_ds.pipe.deepspeed import ds_internals

from ..errors import ArgumentsError

EXIT_CODE = 4  # not 1 (a rank died or froze), which slurm/pretrain_gpt.slurm requeues: a new start meets the same peak
KINDS = {"ForwardOp": "F", "BackwardOp": "BW", "BackwardInputOp": "B", "BackwardWeightOp": "W"}
_state = {"engine": None, "args": None}


def add_out_of_memory_args(parser):
    g = parser.add_argument_group("out of memory")
    g.add_argument("--inject-oom", type=int, nargs="+", default=None, metavar="N",
                   help="fault injection: RANK ITER [MB]: the allocator of rank RANK fails in the forward op of "
                        "micro-batch MB (default 1) at iteration ITER")


def check_out_of_memory_args(args):
    if args.inject_oom is not None and len(args.inject_oom) not in (2, 3):
        raise ArgumentsError(f"--inject-oom takes RANK ITER [MB], got {len(args.inject_oom)} numbers")


def is_out_of_memory(error):
    import torch
    return isinstance(error, (MemoryError, torch.OutOfMemoryError))


def watch(args, engine):
    """Remember the engine (its stage and running op, for the report); arm --inject-oom."""
    import torch
    import torch.distributed as dist
    _state.update(engine=engine, args=args)
    spec = args.inject_oom
    if not spec or spec[0] != dist.get_rank():
        return
    iteration, mb = spec[1], spec[2] if len(spec) > 2 else 1

    def fail(module, inputs):
        running = getattr(_state["engine"].tracer, "running", None) if _state["engine"] else None
        if (running and KINDS.get(running[0]) == "F" and running[1].get("mb") == mb
                and _state["engine"].global_steps + 1 == iteration):
            raise MemoryError(f"--inject-oom: allocation failed (rank {spec[0]}, iteration {iteration}, "
                              f"micro-batch {mb})")
    torch.nn.modules.module.register_module_forward_pre_hook(fail)


def _peak():
    import resource
    import torch
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return f"{torch.cuda.max_memory_allocated() / 2 ** 30:.2f} GiB allocated on the GPU (peak)"
    return f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20:.2f} GiB resident (peak)"


def _op():
    engine = _state["engine"]
    if engine is None:
        return "while building the model, before training"
    where = f"at iteration {engine.global_steps + 1}"
    running = getattr(getattr(engine, "tracer", None), "running", None)
    if running is None:  # DeepSpeed's own engine: its instruction, no micro-batch
        instr = ds_internals.running_instruction(engine)
        return f"in {instr} {where}" if instr else where
    name, kw = running
    if name == "OverlappedOps":  # an overlapped unit (pipe/moe/overlap.py): both its ops run at once
        ops = " and ".join(f"{op.kind.name} of micro-batch {op.mb} (replica {op.replica}, virtual stage {op.stage})"
                           for op in kw["ops"])
        return f"in the overlapped unit of {ops} {where}"
    if name not in KINDS:
        return f"in {name} {where}"
    seg = f", segment {kw['seq']}" if kw.get("seq") else ""
    return (f"in {KINDS[name]} of micro-batch {kw['mb']} (replica {kw['replica']}, virtual stage {kw['stage']}"
            f"{seg}) {where}")


def _knobs():
    args = _state["args"]
    if args is None:
        return "lower --micro-batch-size or use more pipeline stages"
    settings = getattr(args, "pipeline_settings", None)
    budget = getattr(settings, "memory_budget", None)
    return (f"lower --micro-batch-size (now {args.micro_batch_size}); with \"schedule\": \"auto\" a smaller "
            f"pipeline.memory_budget (now {budget}); activation checkpointing --checkpoint-activations (now "
            f"{'on' if args.checkpoint_activations else 'off'}); more Seq1F1B segments pipeline.seq_splits "
            f"(now {getattr(settings, 'seq_splits', 1)})")


def describe(error, rank):
    engine = _state["engine"]
    stage = f", pipeline stage {engine.stage_id}" if engine is not None else ""
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return f"rank {rank}{stage}: out of memory {_op()}: {reason}; {_peak()}; to lower it: {_knobs()}"


def report_and_exit(error, rank):
    """The one line of the rank that ran out of memory, then an exit that waits for no peer."""
    print_error(describe(error, rank))
    sys.stdout.flush()
    os._exit(EXIT_CODE)
