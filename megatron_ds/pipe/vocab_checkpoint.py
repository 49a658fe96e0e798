"""The layer files of a vocabulary-parallel run (docs/SCHEDULES.md: Vocabulary parallelism).

They are those of the run without it: layer 0's holds the whole word embedding (`wte.weight`) and
layer L+2's the whole untied output layer (`weight`; tied, there is none, as gpt_layer_specs has it),
so any layout, the offline readers (convert/ds_format.py) and the Hugging Face export read them
unchanged. A save gathers the slices over the pipeline group; a load cuts each rank's rows from the
files, whichever layout wrote them.

A universal checkpoint (training/universal.py) names the whole parameters as the layout without
vocabulary parallelism does: under `universal_names` DeepSpeed's universal loader reads each renamed
parameter's folder under its whole name, and each slice cuts its rows from the whole one's fp32
weights and Adam moments. DeepSpeed 0.19 members used there (checked on upgrade): the ZeRO optimizer's
`param_names`, each bit16 parameter's `load_hp_checkpoint_state` (deepspeed/checkpoint/
universal_checkpoint.enable_universal_checkpoint) and its `_hp_mapping`'s `lp_fragment_address`,
`get_hp_fragment` and `optim_fragment`, which DeepSpeed's loader then maps into the flat optimizer state.
"""
import contextlib
import functools
import os

import torch
import torch.distributed as dist

from megatron_ds.errors import UserError
from megatron_ds.model.tensor_parallel import comm
from megatron_ds.model.vocab_slices import whole_name
from .zero_internals import ZeroInternals

WTE, HEAD = "wte.weight", "weight"  # the keys of layer 0's and of the output layer's files


class VocabCheckpointError(UserError, NotImplementedError):
    """A checkpoint of vocabulary slices that are split over tensor-parallel ranks too."""


def check_tensor_parallel(vocab_slice, done):
    """A TP rank's layer file holds rows [t V/TP, (t+1) V/TP), which span other pipeline and TP ranks'
    slices: not gathered or cut here yet (fork_flags refuses it at start-up)."""
    if comm.world_size(vocab_slice.group) > 1:
        raise VocabCheckpointError(f'ds_config "pipeline.vocab_parallel" = true with tensor parallelism: checkpoints '
                                   f"of the vocabulary slices are not {done} yet at TP > 1")


def head_layer(module) -> int:
    """The output layer's global index: one past the vocabulary-parallel layer list (L+2)."""
    return len(module._layer_specs)


def gather_whole(module) -> dict:
    """{"wte": the whole word embedding, "head": the whole output layer}, each on the rank that writes its
    file (data-parallel rank 0's owner of layer 0, of the final norm: replica 0's), None elsewhere and
    for a tied head: every pipeline rank's rows in rank order (vocab_range cuts equal slices in order).
    A collective of data-parallel rank 0's pipeline group, gathered to the writer alone (the whole
    matrices may be large)."""
    grid, vocab = module._grid, module.vocab_slice
    check_tensor_parallel(vocab, "written")
    writers = {"wte": module.stage_owner(0), "head": module.stage_owner(len(module._layer_specs) - 1)}
    whole = dict.fromkeys(writers)
    if grid.data_parallel_id != 0:
        return whole
    group = grid.get_pipe_parallel_group()
    for key, writer in writers.items():
        part = getattr(vocab, key)
        if part is None:
            continue
        mine = module.stage_id == writer
        parts = [torch.empty_like(part) for _ in range(dist.get_world_size(group))] if mine else None
        dist.gather(part.detach().contiguous(), parts, dst=grid.stage_to_global(stage_id=writer), group=group)
        if mine:
            whole[key] = torch.cat(parts)
    return whole


@contextlib.contextmanager
def with_whole_embedding(layer0, wte):
    """Layer 0's state dict (the embedding without its word table) with the whole one added."""
    handle = layer0.register_state_dict_post_hook(
        lambda module, state, prefix, meta: state.__setitem__(prefix + WTE, wte))
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def without_whole_embedding(layer0):
    """Layer 0 loads its file without the word table (load_slice cuts this rank's rows of it)."""
    handle = layer0.register_load_state_dict_pre_hook(
        lambda module, state, prefix, *rest: state.pop(prefix + WTE, None))
    try:
        yield
    finally:
        handle.remove()


def layer_path(module, ckpt_dir, idx):
    return module.ckpt_layer_path(ckpt_dir, idx - module._local_start)  # DeepSpeed's name for global layer idx


def save_head(module, save_dir, checkpoint_engine, head):
    """The output layer's file, as LMHead's own, through the checkpoint engine like every layer file."""
    checkpoint_engine.save(state_dict={HEAD: head}, path=layer_path(module, save_dir, head_layer(module)))


def load_slice(module, load_dir):
    """This rank's rows of the word embedding and the output layer, from the whole ones in the files."""
    vocab = module.vocab_slice
    check_tensor_parallel(vocab, "read")
    rows = slice(vocab.start, vocab.end)
    files = [(vocab.wte, 0, WTE)] + ([(vocab.head, head_layer(module), HEAD)] if vocab.head is not None else [])
    with torch.no_grad():
        for param, idx, key in files:
            # mmap: only this rank's rows are read (every file was checked weights-only before the load began)
            state = torch.load(layer_path(module, load_dir, idx), map_location="cpu", weights_only=True, mmap=True)
            if key not in state or state[key].shape[0] < vocab.end:
                raise RuntimeError(f"{layer_path(module, load_dir, idx)}: no whole {key!r} to cut rows "
                                   f"[{vocab.start}, {vocab.end}) from")
            param.copy_(state[key][rows])


@contextlib.contextmanager
def universal_names(zero, vocab):
    """DeepSpeed's universal loader reads zero/<name> through each parameter's load_hp_checkpoint_state
    (set by DeepSpeed on every bit16 parameter); a parameter that vocabulary parallelism renames reads its
    whole name's folder instead, and a slice its rows of it (`zero`: the ZeRO optimizer, `vocab`: the
    VocabSlice)."""
    replaced = {}
    for lp, name in zero.param_names.items():
        whole = whole_name(name, vocab.names)
        if whole == name:
            continue
        replaced[lp] = lp.load_hp_checkpoint_state
        if name in vocab.names["slices"]:
            lp.load_hp_checkpoint_state = functools.partial(_load_rows, lp, whole, vocab)
        else:
            lp.load_hp_checkpoint_state = functools.partial(_load_renamed, replaced[lp], whole)
    try:
        yield
    finally:
        for lp, load in replaced.items():
            lp.load_hp_checkpoint_state = load


def _load_renamed(load, whole, folder, *args, **kwargs):
    return load(os.path.join(os.path.dirname(folder), whole), *args, **kwargs)


def _load_rows(lp, whole, vocab, folder, *args, **kwargs):
    """DeepSpeed's load_hp_checkpoint_state for a slice: rows [start, end) of the whole parameter's fp32
    weights (into this rank's master partition) and optimizer states (its fragments); returns the step.
    A vocabulary padded further than the saved one gets zero rows, as DeepSpeed's loader adds them."""
    from deepspeed.checkpoint.constants import FP32_WEIGHT_KEY, PARAM
    folder = os.path.join(os.path.dirname(folder), whole)
    mapping = ZeroInternals.hp_mapping(lp)
    mapping.optim_fragment = {}
    address, step = mapping.lp_fragment_address, None
    for file in sorted(os.listdir(folder)):
        key, ext = os.path.splitext(file)
        if ext != ".pt":
            continue
        state = torch.load(os.path.join(folder, file), map_location="cpu", weights_only=True)
        if key == "step":
            step = state
            continue
        full = state[PARAM]
        if full.shape[0] < vocab.end:
            full = torch.nn.functional.pad(full, (0, 0, 0, vocab.end - full.shape[0]))
        fragment = full[vocab.start:vocab.end].flatten().narrow(0, address.start, address.numel)
        if key == FP32_WEIGHT_KEY:
            mapping.get_hp_fragment().data.copy_(fragment)
        else:
            mapping.optim_fragment[key] = fragment.clone()
    return step
