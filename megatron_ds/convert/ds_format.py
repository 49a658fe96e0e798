"""Reading and writing the weights of a megatron_ds checkpoint, outside any process group.

A checkpoint is DeepSpeed's pipeline layout (see megatron_ds/training/checkpoint/save_load.py):
SAVE/latest names the tag; SAVE/TAG/layer_XX-model_states.pt holds global layer XX's
state dict (one file per layer whatever the schedule, pipeline size, data-parallel
size or BitPipe replica count: data-parallel rank 0 of replica 0 writes it), and
SAVE/TAG/mp_rank_00_model_states.pt holds DeepSpeed's state and our client state
(the run's arguments), SAVE/TAG/manifest.json every file's size and CRC-32 (checked
before reading). Optimizer shards are not read or written here. With tensor parallelism
each layer has one file per TP rank, layer_XX-model_YY-model_states.pt, which are merged
here into the whole (TP size 1) tensors by the split model/universal_info.py declares.
"""
import glob
import os
import re
from collections import OrderedDict

from megatron_ds.training.checkpoint import safe_load
from megatron_ds.training.errors import CheckpointError
from megatron_ds.training.checkpoint.manifest import verify_manifest, write_manifest
from megatron_ds.training.checkpoint.universal import read_tag

from . import ToolError

MODEL_STATES = "mp_rank_00_model_states.pt"


def layer_file(idx):
    return f"layer_{idx:02d}-model_states.pt"


def tp_layer_files(tag_dir, idx):
    """[layer_XX-model_YY-model_states.pt paths in TP rank order] (empty without tensor parallelism)."""
    pattern = re.compile(rf"layer_{idx:02d}-model_(\d+)-model_states\.pt$")
    found = {}
    for path in glob.glob(os.path.join(tag_dir, f"layer_{idx:02d}-model_*-model_states.pt")):
        m = pattern.search(os.path.basename(path))
        if m:
            found[int(m.group(1))] = path
    if found and sorted(found) != list(range(len(found))):
        raise ToolError(f"{tag_dir}: layer {idx} has the files of tensor-parallel ranks {sorted(found)}, "
                        f"not 0..{len(found) - 1}")
    return [found[r] for r in range(len(found))]


def merge_tp(pieces, kind, sections):
    """The whole tensor from every TP rank's slice, as the parallel layers cut it."""
    import torch
    from megatron_ds.model.tensor_parallel.layers import unshard  # lazy: torch, so --help is quick
    if kind == "replicated":
        return pieces[0]
    if kind == "row":
        return torch.cat(pieces, 1)
    return unshard(pieces, 0, list(sections) if sections else None)  # column, vocab, qkv, swiglu


def _read_layer(tag_dir, idx, splits):
    """{local name: tensor} of global layer idx: its file, or its TP ranks' files merged."""
    paths = tp_layer_files(tag_dir, idx)
    if not paths:
        return _load(os.path.join(tag_dir, layer_file(idx)))
    shards = [_load(p) for p in paths]
    return {name: merge_tp([sd[name] for sd in shards], *splits.get((idx, name), ("replicated", None)))
            for name in shards[0]}


def checkpoint_tag_dir(load_dir, tag=None):
    """SAVE/TAG of `tag`, or of the tag SAVE/latest names."""
    if not os.path.isdir(load_dir):
        raise ToolError(f"{load_dir}: no such checkpoint folder")
    if tag is not None:
        return _verified(load_dir, tag, f"{os.path.join(load_dir, tag)}: no such step folder")
    latest = os.path.join(load_dir, "latest")
    try:
        tag = read_tag(load_dir)
    except (OSError, UnicodeDecodeError) as e:
        raise ToolError(f"{latest}: unreadable ({e}); it should hold the tag of the newest complete step") from None
    if tag is None:
        raise ToolError(f"{latest}: missing; a checkpoint folder names its newest complete step in 'latest' "
                        "(pretrain_gpt.py --save writes it last)")
    if not tag:  # else SAVE itself would pass for the tag's folder
        raise ToolError(f"{latest}: empty; it should hold the tag of the newest complete step")
    return _verified(load_dir, tag, f"{latest} names {tag!r}, but {os.path.join(load_dir, tag)} does not exist")


def _verified(load_dir, tag, missing):
    """SAVE/TAG, its files checked against the manifest; `missing`: the message when there is no such folder."""
    tag_dir = os.path.join(load_dir, tag)
    if not tag or not os.path.isdir(tag_dir):
        raise ToolError(missing)
    try:  # the weights and the client state, against the sizes and CRC-32s saved with them
        verify_manifest(tag_dir, skip=lambda rel: "optim_states" in rel)
    except CheckpointError as e:
        raise ToolError(str(e)) from None
    return tag_dir


def _load(path):
    if not os.path.isfile(path):
        raise ToolError(f"{path}: missing from the checkpoint")
    try:
        return safe_load.load(path)
    except CheckpointError as e:
        raise ToolError(str(e)) from None


def read_saved_args(tag_dir):
    """(the run's arguments, the iteration) from the client state."""
    state = _load(os.path.join(tag_dir, MODEL_STATES))
    if state.get("args") is None:
        raise ToolError(f"{os.path.join(tag_dir, MODEL_STATES)}: no 'args' in the client state "
                        "(not saved by pretrain_gpt.py)")
    args = state["args"]
    info = state.get("checkpoint_info") or {}
    if getattr(args, "padded_vocab_size", None) is None and "padded_vocab_size" in info:
        args.padded_vocab_size = info["padded_vocab_size"]
    return args, state.get("iteration", 0)


def load_into(model, tag_dir):
    """Copy every layer file into `model` (a GPTModel); every parameter must be found, with its shape.

    The model takes the files' dtype (a bf16 run saves bf16 weights)."""
    import torch
    from megatron_ds.model.universal_info import layer_parameters  # lazy: torch
    params = model.named_parameters_by_layer()
    splits = layer_parameters(model.config)
    files = {}
    for idx, name in params:
        if idx not in files:
            files[idx] = _read_layer(tag_dir, idx, splits)
    dtypes = {t.dtype for sd in files.values() for t in sd.values() if torch.is_floating_point(t)}
    if len(dtypes) == 1:
        model.to(dtypes.pop())
    with torch.no_grad():
        for (idx, name), p in params.items():
            path = os.path.join(tag_dir, layer_file(idx))
            if name not in files[idx]:
                raise ToolError(f"{path}: no key {name!r} (holds {sorted(files[idx])})")
            t = files[idx][name]
            if tuple(t.shape) != tuple(p.shape):
                raise ToolError(f"{path}: {name!r} has shape {tuple(t.shape)}, the model's arguments "
                                f"need {tuple(p.shape)}")
            p.copy_(t)
    return model


def write_checkpoint(out_dir, params_by_layer, args, tag="global_step0"):
    """A checkpoint that `--load OUT --finetune` continues under any schedule and pipeline size.

    Only mp_rank_00_model_states.pt is written: DeepSpeed reads file 0 when the number of
    such files differs from the pipeline size; the layer files do the rest."""
    import deepspeed
    import torch
    from megatron_ds.training.checkpoint.save_load import CHECKPOINT_VERSION  # lazy: DeepSpeed
    tag_dir = os.path.join(out_dir, tag)
    os.makedirs(tag_dir)
    by_layer = {}
    for (idx, name), t in sorted(params_by_layer.items()):
        by_layer.setdefault(idx, OrderedDict())[name] = t.detach().contiguous().clone()
    for idx, sd in by_layer.items():
        torch.save(sd, os.path.join(tag_dir, layer_file(idx)))
    state = {
        "module": None, "buffer_names": [], "optimizer": None, "param_shapes": None, "lr_scheduler": None,
        "data_sampler": None, "random_ltd": None, "skipped_steps": 0, "global_steps": 0, "global_samples": 0,
        "dp_world_size": 1, "mp_world_size": 1, "ds_version": deepspeed.__version__,
        # our client state (training/checkpoint/save_load.save_checkpoint's keys)
        "checkpoint_version": CHECKPOINT_VERSION, "iteration": 0, "consumed_train_samples": 0,
        "consumed_valid_samples": 0, "tokens": 0, "args": args,
        "checkpoint_info": {"padded_vocab_size": args.padded_vocab_size},
    }
    torch.save(state, os.path.join(tag_dir, MODEL_STATES))
    write_manifest(tag_dir)
    for name, text in (("latest", tag), ("latest_checkpointed_iteration.txt", "0")):
        with open(os.path.join(out_dir, name), "w") as f:
            f.write(text)
