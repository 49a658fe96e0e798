"""Load ZeRO-1 optimizer state saved under another pipeline layout, parameter by parameter.

DeepSpeed's ZeRO shards are flat slices of the parameters one pipeline rank held when it
saved, so they only load into the same schedule placement, pipeline and data-parallel size.
But every shard also names its parameters (`param_slice_mappings`: name -> slice of the
shard) and the parameter names of a pipeline module are global (the layer index comes
first), so the state of each parameter can be put back together from the shards of every
saved rank and cut again for this rank's partition. This is what DeepSpeed's universal
checkpoint does offline; here it happens at load time, for fp32 master weights and every
optimizer state tensor (Adam's moments), with the optimizer's step count kept.

Vocabulary parallelism (model/vocab_slices.py) names its parameters otherwise: each pipeline rank's
slice of the word embedding and of the output layer is rows [start, end) of the whole parameter, and
tied, layer 0 is no tied module. Both sides are read in the names of the layout without it
(whole_names, recorded in the saved pipeline layout): the saved slices are joined in pipeline-rank
order, and this rank's slice is cut from the whole parameter's state.

With tensor parallelism (the same TP size on both sides: another one goes through the universal
checkpoint) a shard's model-parallel index is pipeline rank x TP + TP rank (DeepSpeed's
PipelineParallelGrid), and every TP rank's slice of a parameter has the parameter's name: each rank
reads the shards of its own TP rank. The word embedding and output layer are the exception when
vocabulary parallelism is on either side: vocabulary slice j TP + t sits in shard j TP + t, and TP rank
t's rows of the whole matrix without vocabulary parallelism are [t V/TP, (t+1) V/TP), so both are
joined over every shard in index order into the whole matrix, and each rank cuts its rows of it.

The DeepSpeed 0.19 ZeRO stage 1/2 members used (private, checked on upgrade):
`optimizer` (the wrapped torch optimizer, one flat fp32 parameter per group),
`bit16_groups`, `single_partition_of_fp32_groups`, `param_names`, `_hp_optimizer_states_linked`,
`_load_global_state`, and each model parameter's `_hp_mapping` (`lp_fragment_address`,
`hp_fragment_address`); the shard file keys `optimizer_state_dict`, `base_optimizer_state`,
`base_optimizer_state_step`, `single_partition_of_fp32_groups`, `param_slice_mappings`.
"""
import glob
import os
import re

import torch

from megatron_ds.model.vocab_slices import whole_name
from megatron_ds.pipe.deepspeed.zero_internals import ZeroInternals

from . import safe_load

FP32 = "fp32"  # our key for the master weights next to the optimizer's own state keys
_SHARD = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_?optim_states\.pt$")


class RelayoutError(ValueError):
    """The saved shards cannot be mapped onto this run's parameters."""


def shard_files(ckpt_dir):
    """{(pipeline rank, data-parallel rank): path} of a checkpoint's ZeRO optimizer shards."""
    found = {}
    for path in glob.glob(os.path.join(ckpt_dir, "*zero_pp_rank_*optim_states.pt")):
        m = _SHARD.search(os.path.basename(path))
        if m:
            found[(int(m.group(2)), int(m.group(1)))] = path
    return found


def _group_states(sd, group):
    """(the optimizer's state dict of one group's flat partition, its step) from one shard."""
    base = sd["base_optimizer_state"]
    if isinstance(base, dict):  # DeepSpeed's default: the torch optimizer's own state_dict
        state = base["state"][group]
        return state, state.get("step")
    return base[group], sd["base_optimizer_state_step"]  # elastic_checkpoint: a list of group states


def gather_by_name(ckpt_dir, names=None, tp_rank=0, tp_size=1, vocab=(), only=None):
    """{parameter name: {state key: flat tensor}}, the optimizer step and one shard's own state dict,
    of TP rank `tp_rank` of `tp_size` (the checkpoint's TP size).

    A parameter cut between data-parallel ranks is the concatenation of its slices in
    data-parallel order; one held by several pipeline ranks (tied embeddings) is taken once.
    A vocabulary matrix (a slice in `names`, the saved layout's whole_names, or a whole name in
    `vocab`) is joined over every TP rank too: the slices in shard order, a whole one's TP rows in
    TP order, under the whole parameter's name. `only`: the whole names wanted (None: all).
    """
    files = shard_files(ckpt_dir)
    if not files:
        raise RelayoutError(f"{ckpt_dir} holds no ZeRO optimizer shards (*zero_pp_rank_*optim_states.pt)")
    if len({mp for mp, _ in files}) % tp_size:
        raise RelayoutError(f"{ckpt_dir}: its shards are not {tp_size} tensor-parallel ranks per pipeline rank")
    slices = (names or {}).get("slices", {})
    vocab = set(vocab) | set(slices.values())
    params, rows, step, first = {}, {}, None, None
    for mp in sorted({p for p, _ in files}):
        mine = mp % tp_size == tp_rank
        if not (mine or vocab):  # another TP rank's shards hold nothing of this rank's
            continue
        pieces = {}
        for dp in sorted(d for p, d in files if p == mp):
            sd = safe_load.load(files[(mp, dp)], mmap=True)
            sd = sd["optimizer_state_dict"]
            if mine and first is None:
                first = sd
            for group, mapping in enumerate(sd["param_slice_mappings"]):
                state, group_step = _group_states(sd, group)
                step = group_step if step is None else step
                flat = sd["single_partition_of_fp32_groups"][group]
                tensors = {k: v for k, v in state.items() if torch.is_tensor(v) and v.dim() == 1}
                tensors[FP32] = flat
                for name, addr in mapping.items():
                    whole = whole_name(name, names)
                    if (only is not None and whole not in only) or not (mine or whole in vocab):
                        continue
                    piece = {k: v.narrow(0, addr.start, addr.numel) for k, v in tensors.items()}
                    pieces.setdefault(name, []).append(piece)
        for name, parts in pieces.items():
            joined = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
            whole = whole_name(name, names)
            if whole in vocab:  # row order: a slice's shard index, a whole one's TP rank (taken once)
                rows.setdefault(whole, {}).setdefault(mp if name in slices else mp % tp_size, joined)
            else:
                params.setdefault(whole, joined)
    for name, parts in rows.items():
        ordered = [parts[i] for i in sorted(parts)]
        params[name] = {k: torch.cat([p[k] for p in ordered]) for k in ordered[0]}
    return params, step, first


def restore_by_name(zero, ckpt_dir, saved_names=None, vocab_slice=None, tp_rank=0, tp_size=1):
    """Fill this rank's ZeRO partitions (fp32 masters and optimizer state) from `ckpt_dir`'s shards.

    `saved_names`: the checkpoint's whole_names (saved under vocabulary parallelism, else None);
    `vocab_slice`: this run's VocabSlice (None without vocabulary parallelism); `tp_rank` of `tp_size`:
    this rank's place in the tensor-parallel group (the checkpoint's TP size is the same)."""
    names = vocab_slice.names if vocab_slice is not None else None
    vocab = set((names or {}).get("slices", {}).values()) | set((saved_names or {}).get("slices", {}).values())
    params, step, shard = gather_by_name(ckpt_dir, saved_names, tp_rank, tp_size, vocab)
    internals = ZeroInternals(zero)
    internals.load_global_state(shard)
    base = zero.optimizer
    for group, lp_params in enumerate(zero.bit16_groups):
        flat = zero.single_partition_of_fp32_groups[group]
        keys = None
        for lp in lp_params:
            mapping = ZeroInternals.hp_mapping(lp)
            if mapping is None:  # no slice of this parameter in this data-parallel rank's partition
                continue
            name = whole_name(zero.param_names[lp], names)
            if name not in params:
                raise RelayoutError(f"parameter {name} is not in the checkpoint's optimizer shards")
            saved = params[name]
            if names and zero.param_names[lp] in names["slices"]:  # rows [start, end) of the whole
                first = vocab_slice.start * (lp.numel() // (vocab_slice.end - vocab_slice.start))
                saved = {k: v.narrow(0, first, lp.numel()) for k, v in saved.items()}
            elif name in vocab and saved[FP32].numel() == tp_size * lp.numel():  # TP rank's rows of the whole
                saved = {k: v.narrow(0, tp_rank * lp.numel(), lp.numel()) for k, v in saved.items()}
            if saved[FP32].numel() != lp.numel():
                raise RelayoutError(f"parameter {name} has {lp.numel()} elements, "
                                    f"{saved[FP32].numel()} in the checkpoint")
            if keys is None:
                keys = [k for k in saved if k != FP32]
                state = {k: torch.zeros_like(flat) for k in keys}  # zero in the alignment padding, as DeepSpeed has it
            lp_addr, hp_addr = mapping.lp_fragment_address, mapping.hp_fragment_address
            for key, dst in [(FP32, flat.data)] + [(k, state[k]) for k in keys]:
                src = saved[key].narrow(0, lp_addr.start, lp_addr.numel)
                dst.narrow(0, hp_addr.start, hp_addr.numel).copy_(src)
        if keys is None:
            continue
        if step is not None:
            state["step"] = step.clone() if torch.is_tensor(step) else step
        base.state[flat] = state
    internals.relink_hp_optimizer_states()  # the model parameters' views of the state are relinked lazily
