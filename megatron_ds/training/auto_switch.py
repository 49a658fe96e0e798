"""Switch an engine to the schedule `"schedule": "auto"` chose when it places the chunks
differently (pipe/auto.py swaps in place otherwise): the resume-under-another-schedule path.

The engine saves a DeepSpeed checkpoint to a temporary folder, the caller builds the module,
optimizer and engine of the chosen schedule, and the checkpoint loads into it as a resume under
another layout does (training/checkpointing.py: weights, lr schedule and step counters as saved,
the ZeRO-1 optimizer state re-cut parameter by parameter), so training goes on with the same
numbers. The RNG states are put back after the build (building a module draws from them). The
folder must be visible to every rank: under --save when there is one, else the system's temporary
folder (one node).
"""
import os
import shutil
import tempfile

from .checkpointing import LoadPlan, restore
from .initialize import get_rng_state, set_rng_state

TAG = "auto_switch"


def shared_folder(save_dir=None):
    """A new empty folder every rank gets the same path of (rank 0 makes it, broadcasts the path)."""
    import torch.distributed as dist
    box = [None]
    if dist.get_rank() == 0:
        if save_dir:
            os.makedirs(save_dir, exist_ok=True)
        box[0] = tempfile.mkdtemp(prefix=".auto-switch-", dir=save_dir or None)
    dist.broadcast_object_list(box, src=0)
    return box[0]


def switch_engine(engine, build, save_dir=None):
    """`build(ds_config)` -> the new engine; returns it, with the old engine's whole training state.
    `engine.pending_switch` holds the decision (pipe/auto.py)."""
    import torch.distributed as dist
    from megatron_ds.pipe.auto import chosen_ds_config
    decision = engine.pending_switch
    folder = shared_folder(save_dir)
    try:
        engine.save_checkpoint(folder, tag=TAG, client_state={}, save_latest=False)
        dist.barrier()
        rng = get_rng_state()
        ds_config = chosen_ds_config(engine.config, decision)
        del engine  # the caller's reference goes when it takes the new one
        new = build(ds_config)
        set_rng_state(rng)
        restore(new, folder, TAG, LoadPlan("by_name", True, "auto switch"))
        dist.barrier()
    finally:
        if dist.get_rank() == 0:
            shutil.rmtree(folder, ignore_errors=True)
    if dist.get_rank() == 0:
        print(f"auto schedule: switched from {decision['start']} to {decision['choice']['label']} "
              "through a checkpoint (another chunk placement)", flush=True)
    return new


def rebuild_trainer_engine(trainer):
    """switch_engine for the pretraining loop: the new engine, lr schedule and settings go to `trainer`."""
    from megatron_ds.pipe.build import pipeline_settings
    from . import timeouts
    from .model_setup import setup_model_and_optimizer
    args = trainer.args

    def build(ds_config):
        args.ds_config, args.pipeline_settings = ds_config, pipeline_settings(ds_config)
        engine, trainer.lr_scheduler = setup_model_and_optimizer(args)
        return engine

    trainer.engine = switch_engine(trainer.engine, build, args.save)
    timeouts.label_groups(trainer.engine.grid, trainer.engine.module)
    trainer.current_gbs = None  # the new engine takes the batch size of the ramp-up again
