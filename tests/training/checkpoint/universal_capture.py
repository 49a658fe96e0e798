"""pretrain_gpt.py for the universal checkpoint tests, which also writes what the ZeRO optimizer holds, whole
and by parameter name, when a checkpoint is saved (before DeepSpeed writes it, or copies it for --async-save) and right after one is loaded:
the fp32 master weights and Adam's moments (gathered over the data- and tensor-parallel ranks), the module's
own (bf16 or fp32) weights, and Adam's step counters. So a test compares a resumed run's optimizer with the
saved one under another layout, exactly.

    torchrun ... tests/training/checkpoint/universal_capture.py <pretrain_gpt.py flags> --capture-dir DIR

writes DIR/{save<iteration>,load}-stage<pipeline stage>-dp<data-parallel rank>.pt from each stage's first tensor-
and data-parallel rank (and, for the experts of an expert-parallel run, from the first rank of each expert-data-
parallel group): {"params": {name: {"fp32", "exp_avg", "exp_avg_sq", "module"}}, "buffers": {name: the module's
persistent buffers, from replica 0}, "steps": [...], "iteration": N}.
"""
import os
import sys


def optimizer_state(engine, args):
    """This stage's whole parameters and their optimizer state (a collective over its TP and DP ranks)."""
    import torch
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from megatron_ds.model.tensor_parallel import gather_full, get_parallel_state
    group = get_parallel_state().get_tensor_model_parallel_group() if args.tensor_model_parallel_size > 1 else None
    zero = engine.optimizer
    adam = zero.optimizer.state  # keyed by the flat fp32 partitions
    if adam:  # DeepSpeed links the parameters' views of the moments after its first group's step, when the
        zero._hp_optimizer_states_linked = False  # other groups have no state yet: link them all now
        zero._lazy_init_hp_params_optimizer_state()
    params = {}
    for name, p in engine.module.named_parameters():
        owner = engine.module.get_submodule(name.rsplit(".", 1)[0])
        entry = {"fp32": safe_get_full_fp32_param(p), "module": p.detach()}
        for key in ("exp_avg", "exp_avg_sq"):
            entry[key] = safe_get_full_optimizer_state(p, key) if adam else None
        params[name] = {k: None if t is None else gather_full(owner, name.rsplit(".", 1)[1], t, group).clone()
                        for k, t in entry.items()}
    steps = sorted({int(torch.as_tensor(s["step"]).item()) for s in adam.values() if "step" in s})
    names = {name for name, _ in engine.module.named_parameters()}
    buffers = {k: t.clone() for k, t in engine.module.state_dict().items() if k not in names}
    return {"params": params, "steps": steps, "buffers": buffers}


def holds_first_copy(engine, name):
    """Whether this rank writes `name`: data-parallel replica 0 of its stage, or for an expert of an
    expert-parallel run (held by one EP rank's expert-data-parallel group) that group's first rank."""
    import torch.distributed as dist
    from deepspeed.utils import groups
    if engine.grid.get_slice_parallel_rank() != 0:
        return False
    p = engine.module.get_parameter(name)
    if getattr(p, "allreduce", True):
        return engine.grid.get_data_parallel_rank() == 0
    return dist.get_rank(groups._get_expert_data_parallel_group(p.group_name)) == 0


def write(engine, args, label, iteration):
    import torch
    state = optimizer_state(engine, args)
    mine = {k: v for k, v in state["params"].items() if holds_first_copy(engine, k)}
    first = engine.grid.get_data_parallel_rank() == 0 and engine.grid.get_slice_parallel_rank() == 0
    if mine or first:
        name = f"{label}-stage{engine.stage_id}-dp{engine.grid.get_data_parallel_rank()}.pt"
        torch.save({**state, "params": mine, "buffers": state["buffers"] if first else {}, "iteration": iteration},
                   os.path.join(CAPTURE_DIR, name))


def main():
    from megatron_ds.training.checkpoint import save_load
    from megatron_ds.training import loop
    save, load = save_load.write_step, save_load.load_checkpoint

    def capturing_save(engine, args, iteration, *rest, **kwargs):  # both paths: synchronous and --async-save
        write(engine, args, f"save{iteration}", iteration)
        return save(engine, args, iteration, *rest, **kwargs)

    def capturing_load(engine, args):
        state = load(engine, args)
        write(engine, args, "load", state["iteration"])
        return state

    save_load.write_step, save_load.load_checkpoint = capturing_save, capturing_load
    return loop.entry_point(sys.argv[1:])


if __name__ == "__main__":
    at = sys.argv.index("--capture-dir")
    CAPTURE_DIR = sys.argv[at + 1]
    del sys.argv[at:at + 2]
    os.makedirs(CAPTURE_DIR, exist_ok=True)
    sys.exit(main())
