"""The trained weights as a Hugging Face folder (save_pretrained) that transformers loads as it loaded the model.

Each rank holds the model whole but trains only its own stages' layers, so the weights come from the ranks
that hold them: every pipeline rank of data-parallel rank 0 sends its layers' parameters (by the model's own
names; a replica's copy is the same weights) to global rank 0, which writes them into its model and saves it.
The folder is written under a temporary sibling name and renamed at the end: whole or not at all.
"""
import os
import shutil

import torch
import torch.distributed as dist

from .cut import CutError, hf_names


def check_new_folder(folder):
    """`folder` must be new (nothing is overwritten) and its parent a folder: checked before training."""
    folder = os.path.abspath(folder)
    if os.path.exists(folder):
        raise CutError(f"{folder}: already exists (save_pretrained writes a new folder; nothing is overwritten)")
    if not os.path.isdir(os.path.dirname(folder)):
        raise CutError(f"{os.path.dirname(folder)}: no such folder (save_pretrained writes into it)")
    return folder


def held_weights(engine, model):
    """{the model's parameter name: this rank's trained weight, on the CPU} of the layers this rank holds."""
    names = hf_names(engine.module, model)
    return {names[n]: p.detach().to("cpu", copy=True) for n, p in engine.module.named_parameters()}


def save_pretrained(engine, model, folder):
    """Write `model` (the transformers model that `engine`'s module was cut from) with the weights `engine`
    trained into the new folder `folder`, on global rank 0; every rank calls it."""
    folder = check_new_folder(folder)
    mine = held_weights(engine, model) if engine.grid.get_data_parallel_rank() == 0 else {}
    gathered = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, gathered, dst=0)
    if not dist.is_initialized() or dist.get_rank() == 0:
        weights = {k: w for part in gathered for k, w in part.items()}
        missing = {n for n, _ in model.named_parameters()} - set(weights)
        if missing:
            raise RuntimeError(f"save_pretrained: no rank sent {sorted(missing)[:3]}")
        with torch.no_grad():
            for name, weight in weights.items():
                model.get_parameter(name).copy_(weight)
        tmp = os.path.join(os.path.dirname(folder), f".{os.path.basename(folder)}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            model.save_pretrained(tmp)
            os.rename(tmp, folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()
