"""DeepSpeed pipeline checkpoints with Megatron-DeepSpeed's client state.

Layout (DeepSpeed's): SAVE/global_step{N}/layer_XX-model_states.pt,
mp_rank_{stage:02d}_model_states.pt (holds the client state below),
zero_pp_rank_{dp}_mp_rank_{stage:02d}_optim_states.pt, and SAVE/latest naming
the newest complete tag (plus Megatron's latest_checkpointed_iteration.txt).

`latest` is written only after every rank has finished writing its files (a
barrier), by rank 0, through a temporary file and an atomic rename: a save that
dies half-way leaves `latest` pointing at the previous complete checkpoint.

Client state: iteration, consumed train/valid samples and tokens (which fix the
position of the data iterators: the sampler restarts at that sample), the RNG
states of python/numpy/torch(/cuda) of this pipeline stage (data-parallel
replicas share them), the arguments, and the vocabulary size. The lr schedule
and the optimizer (ZeRO shards) are DeepSpeed's own part of the checkpoint.
"""
import argparse
import os

from .initialize import get_rng_state
from .logging_utils import print_rank_0
from .manifest import verify_manifest, write_manifest
from .model_args import MODEL_FAMILY_ARGS

CHECKPOINT_VERSION = 3.0
# Arguments that must match for a checkpoint to load into this model.
MODEL_ARGS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "max_position_embeddings",
              "padded_vocab_size") + MODEL_FAMILY_ARGS
TOPOLOGY_ARGS = ("pipeline_model_parallel_size", "tensor_model_parallel_size", "data_parallel_size")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded into this run; the message says why and what to do."""


def _plain_args(args):
    """The Namespace without objects that only this code version can unpickle."""
    keep = {k: v for k, v in vars(args).items()
            if isinstance(v, (str, int, float, bool, list, tuple, dict, type(None)))}
    return argparse.Namespace(**keep)


def tag_for(iteration):
    return f"global_step{iteration}"


def _write_atomic(path, text):
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(engine, args, iteration, consumed_train_samples, consumed_valid_samples):
    import torch.distributed as dist
    print_rank_0(f"saving checkpoint at iteration {iteration:7d} to {args.save}")
    client_state = {
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": iteration,
        "consumed_train_samples": consumed_train_samples,
        "consumed_valid_samples": consumed_valid_samples,
        "tokens": consumed_train_samples * args.seq_length,
        "args": _plain_args(args),
        "checkpoint_info": {"padded_vocab_size": args.padded_vocab_size},
        "rng_state": get_rng_state(),
    }
    tag = tag_for(iteration)
    engine.save_checkpoint(args.save, tag=tag, client_state=client_state, save_latest=False)
    dist.barrier()  # every rank's files are on disk before `latest` names them
    write_manifest(os.path.join(args.save, tag))
    if dist.get_rank() == 0:
        _write_atomic(os.path.join(args.save, "latest"), tag)
        _write_atomic(os.path.join(args.save, "latest_checkpointed_iteration.txt"), str(iteration))
    dist.barrier()
    print_rank_0(f"  successfully saved checkpoint at iteration {iteration:7d} to {args.save}")


def read_latest_tag(load_dir):
    path = os.path.join(load_dir, "latest")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return f.read().strip()


def _peek_client_state(load_dir, tag):
    """Our keys from mp_rank_00_model_states.pt, read before DeepSpeed loads anything."""
    import torch
    path = os.path.join(load_dir, tag, "mp_rank_00_model_states.pt")
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing: {load_dir}/latest names {tag!r}, which is not a complete "
                              "DeepSpeed checkpoint")
    return torch.load(path, map_location="cpu", weights_only=False)


def _check_compatible(args, saved_args, load_dir, load_optimizer):
    if saved_args is None:
        return
    saved = vars(saved_args)
    for name in MODEL_ARGS:
        if name in saved and saved[name] != getattr(args, name, None):
            raise CheckpointError(f"checkpoint {load_dir} has {name}={saved[name]}, this run has "
                                  f"{getattr(args, name, None)}: the models differ")
    if load_optimizer:
        for name in TOPOLOGY_ARGS:
            if name in saved and saved[name] != getattr(args, name):
                raise CheckpointError(
                    f"checkpoint {load_dir} was saved with {name}={saved[name]}, this run has {getattr(args, name)}; "
                    "ZeRO optimizer shards only load into the same pipeline x tensor x data-parallel layout "
                    "(use --no-load-optim or --finetune to load the weights alone)")


def load_checkpoint(engine, args):
    """Load args.load if it has a `latest`; returns the training state to resume from.

    {"iteration", "consumed_train_samples", "consumed_valid_samples", "rng_state" (or None)}.
    """
    state = {"iteration": 0, "consumed_train_samples": 0, "consumed_valid_samples": 0, "rng_state": None}
    if not args.load:
        return state
    tag = read_latest_tag(args.load)
    if tag is None:
        print_rank_0(f"Unable to find latest file at {os.path.join(args.load, 'latest')}, "
                     "will not load any checkpoint and will start from random")
        return state
    load_optimizer = not (args.no_load_optim or args.finetune)
    verify_manifest(os.path.join(args.load, tag), skip=lambda rel: not load_optimizer and "optim_states" in rel)
    peek = _peek_client_state(args.load, tag)
    _check_compatible(args, peek.get("args"), args.load, load_optimizer)
    print_rank_0(f"loading checkpoint {tag} from {args.load}")
    load_path, client_state = engine.load_checkpoint(
        args.load, tag=tag, load_optimizer_states=load_optimizer,
        load_lr_scheduler_states=not args.finetune, load_module_only=args.finetune)
    if load_path is None:
        raise CheckpointError(f"DeepSpeed could not load {tag} from {args.load}")
    client_state = client_state or {}
    if not args.finetune:
        state["iteration"] = int(client_state.get("iteration", 0))
        state["consumed_train_samples"] = int(client_state.get("consumed_train_samples", 0))
        state["consumed_valid_samples"] = int(client_state.get("consumed_valid_samples", 0))
        if not args.no_load_rng:
            state["rng_state"] = client_state.get("rng_state")
    print_rank_0(f"  successfully loaded checkpoint from {args.load} at iteration {state['iteration']}")
    return state
