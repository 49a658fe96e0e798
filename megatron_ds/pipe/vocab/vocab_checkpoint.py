"""The layer files of a vocabulary-parallel run (docs/SCHEDULES.md: Vocabulary parallelism).

They are those of the run without it: layer 0's holds the whole word embedding (`wte.weight`) and
layer L+2's the whole untied output layer (`weight`; tied, there is none, as gpt_layer_specs has it),
so any layout, the offline readers (convert/ds_format.py) and the Hugging Face export read them
unchanged. With TP each TP rank's file holds its rows [t V/TP, (t+1) V/TP), as the TP layers'
VocabParallelEmbedding and output layer split them. A save gathers the slices over the model-parallel
group (each TP group its pipeline rank's block, then the blocks over the pipeline group: row order);
a load cuts each rank's rows from the one or two TP files that hold them, whichever layout wrote them.

A universal checkpoint (training/checkpoint/universal.py) names the whole parameters as the layout without
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

from megatron_ds.model.tensor_parallel import comm
from megatron_ds.model.vocab_slices import whole_name
from ..deepspeed import ds_internals as ds
from ..deepspeed.zero_internals import ZeroInternals

WTE, HEAD = "wte.weight", "weight"  # the keys of layer 0's and of the output layer's files


def head_layer(module) -> int:
    """The output layer's global index: one past the vocabulary-parallel layer list (L+2)."""
    return len(ds.layer_specs(module))


def gather_whole(module) -> dict:
    """{"wte": the word embedding's rows of this rank's file, "head": the output layer's}, each on the
    ranks that write its files (data-parallel replica 0's owner of layer 0, of the final norm: each of
    its TP ranks its rows [t V/TP, (t+1) V/TP)), None elsewhere and for a tied head. Slice j TP + t is
    rows j TP + t of p TP in order (vocab_range), so pipeline rank j's TP group joins block j and the
    writer joins the blocks. A collective of data-parallel replica 0's model-parallel group, gathered to
    the writers alone (the whole matrices may be large)."""
    grid, vocab = ds.grid(module), module.vocab_slice
    writers = {"wte": module.stage_owner(0), "head": module.stage_owner(len(ds.layer_specs(module)) - 1)}
    whole = dict.fromkeys(writers)
    if grid.data_parallel_id != 0:
        return whole
    pipe, tp, t = grid.get_pipe_parallel_group(), comm.world_size(vocab.group), comm.rank(vocab.group)
    for key, writer in writers.items():
        part = getattr(vocab, key)
        if part is None:
            continue
        part = part.detach().contiguous()
        if tp > 1:
            block = [torch.empty_like(part) for _ in range(tp)]
            dist.all_gather(block, part, group=vocab.group)
            part = torch.cat(block)
        mine = module.stage_id == writer
        parts = [torch.empty_like(part) for _ in range(dist.get_world_size(pipe))] if mine else None
        dist.gather(part, parts, dst=grid.stage_to_global(stage_id=writer), group=pipe)
        if mine:
            rows = torch.cat(parts)
            per = rows.shape[0] // tp
            whole[key] = rows[t * per:(t + 1) * per].clone()
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
    return module.ckpt_layer_path(ckpt_dir, idx - ds.local_start(module))  # DeepSpeed's name for global layer idx


def tp_layer_path(module, ckpt_dir, idx, t):
    """TP rank t's file of global layer idx (DeepSpeed's name: the rank representation of this rank's
    TP rank t peer, '' without TP)."""
    topo = ds.topology_of(ds.grid(module))
    coord = topo.get_coord(module.global_rank)._asdict()
    repr_ = topo.get_rank_repr(rank=topo.get_rank(**{**coord, "model": t})) if "model" in coord else ""
    return os.path.join(ckpt_dir, f"layer_{idx:02d}" + (f"-{repr_}" if repr_ else "") + "-model_states.pt")


def save_head(module, save_dir, checkpoint_engine, head):
    """The output layer's file, as LMHead's own, through the checkpoint engine like every layer file."""
    checkpoint_engine.save(state_dict={HEAD: head}, path=layer_path(module, save_dir, head_layer(module)))


def load_slice(module, load_dir):
    """This rank's rows of the word embedding and the output layer, from the TP files that hold them
    (TP file t: rows [t V/TP, (t+1) V/TP), V/TP = p slices)."""
    vocab = module.vocab_slice
    tp, start, end = comm.world_size(vocab.group), vocab.start, vocab.end
    per = (end - start) * ds.grid(module).get_pipe_parallel_world_size()  # rows of one TP rank's file
    files = [(vocab.wte, 0, WTE)] + ([(vocab.head, head_layer(module), HEAD)] if vocab.head is not None else [])
    with torch.no_grad():
        for param, idx, key in files:
            for t in range(start // per, (end - 1) // per + 1):
                path = tp_layer_path(module, load_dir, idx, t)
                # mmap: only this rank's rows are read (every file was checked weights-only before the load began)
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                lo, hi = max(start, t * per), min(end, (t + 1) * per)
                rows = state[key].shape[0] if key in state else 0
                if rows < hi - t * per or (tp > 1 and rows != per):  # a TP file's rows must be its V/TP
                    raise RuntimeError(f"{path}: {rows} rows of {key!r}, {per if tp > 1 else 'at least ' + str(end)} "
                                       f"needed to cut rows [{start}, {end}) from")
                param[lo - start:hi - start].copy_(state[key][lo - t * per:hi - t * per])


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
