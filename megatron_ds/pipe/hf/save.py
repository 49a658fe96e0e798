"""The trained weights as a Hugging Face folder (save_pretrained) that transformers loads as it loaded the model.

Each rank holds the model whole but trains only its own stages' layers, so the weights come from the ranks
that hold them: every pipeline rank of data-parallel rank 0 sends its layers' parameters (by the model's own
names; a replica's copy is the same weights) to global rank 0, which writes them into its model and saves it.
The folder is written under a temporary sibling name and renamed at the end: whole or not at all.

The tokenizer the run's ids were made with goes into the folder too (transformers' tokenizer.save_pretrained),
read again from the folder that holds it (--tokenizer-name-or-path, by default the --hf-model folder), so that
AutoTokenizer.from_pretrained(folder) works on the saved folder as on the input one; a source folder without a
tokenizer's files leaves the saved one without, which the caller's log line says.
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


# the files transformers' tokenizers are read from (tokenizer_config.json names the class; the rest its vocabulary)
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "vocab.json", "tokenizer.model", "vocab.txt")


def save_pretrained(engine, model, folder, tokenizer_from=None):
    """Write `model` (the transformers model that `engine`'s module was cut from) with the weights `engine`
    trained into the new folder `folder`, on global rank 0, with the tokenizer of the folder `tokenizer_from`
    (None: none); every rank calls it. Returns what became of the tokenizer, in words (rank 0; '' elsewhere)."""
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
        said = write_folder(model, folder, tokenizer_from)
    else:
        said = ""
    if dist.is_initialized():
        dist.barrier()
    return said


def write_folder(model, folder, tokenizer_from=None):
    """`model` and the tokenizer of `tokenizer_from` (when that folder holds one) saved into the new `folder`,
    whole or not at all; returns what became of the tokenizer, in words."""
    tokenizer, said = folder_tokenizer(tokenizer_from)
    tmp = os.path.join(os.path.dirname(folder), f".{os.path.basename(folder)}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        os.rename(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return said


def folder_tokenizer(source):
    """(the tokenizer of the folder `source`, or None; what that means, in words)."""
    if source is None:
        return None, "no tokenizer: none was given"
    if not os.path.isdir(source):
        return None, f"no tokenizer: {source} is not a local folder"
    if not any(os.path.isfile(os.path.join(source, f)) for f in TOKENIZER_FILES):
        return None, f"no tokenizer: {source} holds none ({', '.join(TOKENIZER_FILES)})"
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(source, local_files_only=True), f"with the tokenizer of {source}"
