"""DeepSpeed pipeline checkpoints with Megatron-DeepSpeed's client state.

Layout (DeepSpeed's): SAVE/global_step{N}/layer_XX-model_states.pt,
mp_rank_{stage:02d}_model_states.pt (holds the client state below),
zero_pp_rank_{dp}_mp_rank_{stage:02d}_optim_states.pt, and SAVE/latest naming
the newest complete tag (plus Megatron's latest_checkpointed_iteration.txt). A mixture of
experts under expert parallelism writes the same files as without it (pipe/moe/moe_checkpoint.py).

`latest` is written only after every rank has finished writing its files (a
barrier), by rank 0, through a temporary file and an atomic rename: a save that
dies half-way leaves `latest` pointing at the previous complete checkpoint. A save
that runs out of disk is agreed on by every rank and never named (disk_full.py).
Every file is read weights-only, and tried on every rank before anything loads
(safe_load.py, engine.py): no checkpoint runs code. SAVE/zero_to_fp32.py, the script DeepSpeed
copies there for its users, is ours (recovery_script.py): it reads the weights the same way.

Client state: iteration, consumed train/valid samples and tokens (which fix the
position of the data iterators: the sampler restarts at that sample), the RNG
states of python/numpy/torch(/cuda) of this pipeline stage (data-parallel
replicas share them), the arguments, the vocabulary size, the pipeline
layout (sizes, chunk placement, the EP size) and the stage's persistent buffers
(universal.py). The lr schedule and the optimizer (ZeRO shards) are DeepSpeed's
own part of the checkpoint.

Loading is decided here and only here (`plan_load`): the weights load under any
layout; the lr schedule, DeepSpeed's step counters and the data position load
unless --finetune; the optimizer state loads as DeepSpeed saved it under the same
layout, and is re-cut parameter by parameter (relayout.py) under another
schedule, pipeline or data-parallel size, or with vocabulary parallelism switched on
or off (its layer files hold the whole matrices: pipe/vocab/vocab_checkpoint.py), so a
resumed run continues the same training whatever layout it resumes under. Another tensor-parallel size goes through
DeepSpeed's universal checkpoint (universal.py): every checkpoint carries the
`universal_checkpoint_info` its converter needs, and a run with --universal-checkpoint
loads the converted folder (SAVE/latest_universal) under any TP x PP x DP.
"""
import argparse
import contextlib
import dataclasses
import json
import os

from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO

from megatron_ds.data.dist_utils import print_rank_0
from megatron_ds.model.universal_info import universal_checkpoint_info
from megatron_ds.moe_config import layer_pattern
from megatron_ds.pipe.engine import LAYOUT_KEY, pipeline_layout, saved_layout
from megatron_ds.pipe.vocab.vocab_checkpoint import universal_names
from megatron_ds.pipe.deepspeed.zero_internals import ZeroInternals

from ..errors import CheckpointError
from . import engine as checkpoint_engine, kill_points, recovery_script, safe_load
from ..faults import disk_full
from ..initialize import get_rng_state
from .manifest import verify_manifest, write_manifest
from ..config.model_args import MODEL_FAMILY_ARGS
from ..config.moe_args import moe_config_from_args
from ..model_setup import model_config
from .universal import (BUFFERS_KEY, LATEST as LATEST_UNIVERSAL, conversion_command, persistent_buffers, read_tag,
                        restore_buffers)
from .relayout import RelayoutError, restore_by_name

CHECKPOINT_VERSION = 3.0
# Arguments that must match for a checkpoint to load into this model.
MODEL_ARGS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "max_position_embeddings",
              "padded_vocab_size") + MODEL_FAMILY_ARGS
# what a checkpoint saved before one of them existed meant by its absence (compared as that; the others are skipped)
UNSAVED_MODEL_ARGS = {"kv_channels": None, "rope_scaling": None}


def _plain_args(args):
    """The Namespace without objects that only this code version can unpickle."""
    keep = {k: v for k, v in vars(args).items()
            if isinstance(v, (str, int, float, bool, list, tuple, dict, type(None)))}
    return argparse.Namespace(**keep)


def tag_for(iteration):
    return f"global_step{iteration}"


def write_step_file(step_dir, name, content):
    """A JSON file beside DeepSpeed's in a step folder (temp file, rename; out of room: recorded by
    disk_full); None removes a stale one (a reused tag folder)."""
    path = os.path.join(step_dir, name)
    if content is None:
        if os.path.exists(path):
            os.remove(path)
        return
    disk_full.write_text(path, json.dumps(content, indent=1))


def save_checkpoint(engine, args, iteration, consumed_train_samples, consumed_valid_samples, extra_files=()):
    """A synchronous save: write_step, then commit_step. `extra_files`: [(name, JSON-able content or None)]
    rank 0 writes into the step folder before the manifest lists it (write_step_file), e.g. "schedule":
    "auto"'s decision (training/auto_schedule.py).

    Returns True when the step is complete and `latest` names it. Out of disk (disk_full.py): raises the
    same DiskFullError on every rank, or returns False under --keep-training-on-disk-full.
    """
    write_step(engine, args, iteration, consumed_train_samples, consumed_valid_samples, extra_files)
    return commit_step(args, iteration)


def write_step(engine, args, iteration, consumed_train_samples, consumed_valid_samples, extra_files=(),
               collector=None):
    """Every rank: the step's files through DeepSpeed's save, or, with `collector` (engine.Collector, under
    --async-save), their host copies kept for the background writer; rank 0's small files of ours (extra_files,
    zero_to_fp32.py) are written here either way. Names nothing: commit_step does, once every rank's files are
    whole."""
    print_rank_0(f"saving checkpoint at iteration {iteration:7d} to {args.save}"
                 + (" (in the background)" if collector is not None else ""))
    client_state = {
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": iteration,
        "consumed_train_samples": consumed_train_samples,
        "consumed_valid_samples": consumed_valid_samples,
        "tokens": consumed_train_samples * args.seq_length,
        "args": _plain_args(args),
        "checkpoint_info": {"padded_vocab_size": args.padded_vocab_size},
        "rng_state": get_rng_state(),
        LAYOUT_KEY: pipeline_layout(engine),  # DeepSpeed's stock engine records none of its own
        UNIVERSAL_CHECKPOINT_INFO: universal_info(args),
        BUFFERS_KEY: persistent_buffers(engine.module),  # what a universal load takes from here
    }
    import torch.distributed as dist
    tag = tag_for(iteration)
    step_dir = os.path.join(args.save, tag)
    checkpoint_engine.install(engine)
    recovery_script.take_over(engine)  # DeepSpeed's zero_to_fp32.py would unpickle anything: ours is written below
    disk_full.begin(args, iteration)
    try:
        with checkpoint_engine.writing_through(engine, collector):
            engine.save_checkpoint(args.save, tag=tag, client_state=client_state, save_latest=False)
    except OSError as e:  # outside our checkpoint engine (DeepSpeed's own copies): this rank alone knows
        if disk_full.is_out_of_room(e):
            disk_full.report_alone_and_exit(e, iteration)
        raise
    if dist.get_rank() == 0:
        for name, content in extra_files:
            disk_full.guarded(lambda: write_step_file(step_dir, name, content), os.path.join(step_dir, name))
        disk_full.guarded(lambda: recovery_script.write(args.save), os.path.join(args.save, recovery_script.NAME))
    return step_dir


def commit_step(args, iteration, known=None):
    """Every rank, once its files of `iteration` are on disk (a collective: the ranks agree first): the
    manifest, then `latest` (rank 0, each through a temporary file and a rename). `known`: {file: manifest
    entry} the writers already took (async_save.py); the other files are read here.

    Returns True when the step is committed; out of room anywhere: DiskFullError on every rank, or False under
    --keep-training-on-disk-full (the step folder removed).
    """
    import torch.distributed as dist
    tag = tag_for(iteration)
    step_dir = os.path.join(args.save, tag)
    if _stopped_by_disk(args, step_dir):  # every rank's files are on disk before `latest` names them
        return False
    kill_points.maybe_kill("agreed", iteration, dist.get_rank())
    disk_full.guarded(lambda: write_manifest(step_dir, known), os.path.join(step_dir, "manifest.json"))
    if dist.get_rank() == 0 and not disk_full.failed():
        disk_full.write_text(os.path.join(args.save, "latest"), tag)
        disk_full.write_text(os.path.join(args.save, "latest_checkpointed_iteration.txt"), str(iteration))
    if _stopped_by_disk(args, step_dir):
        return False
    print_rank_0(f"  successfully saved checkpoint at iteration {iteration:7d} to {args.save}")
    return True


def _stopped_by_disk(args, step_dir):
    """Every rank: did any run out of room? (a collective; it is also the save's barrier)."""
    failure = disk_full.agree(step_dir, read_tag(args.save, "latest"))
    if failure is None:
        return False
    if not args.keep_training_on_disk_full:
        raise disk_full.DiskFullError(f"{failure}; the previous checkpoint and {os.path.join(args.save, 'latest')} "
                                      "are intact: free space (or raise the quota) and resume, or pass "
                                      "--keep-training-on-disk-full to train on and retry at the next save")
    print_rank_0(f"WARNING: checkpoint not saved: {failure}; training goes on (--keep-training-on-disk-full), "
                 "the next --save-interval tries again")
    return True


def universal_info(args):
    """What DeepSpeed's ds_to_universal needs to know of the model (Megatron-DeepSpeed's client state key)."""
    settings = getattr(args, "pipeline_settings", None)
    return universal_checkpoint_info(model_config(args), args.padded_vocab_size,
                                     vocab_parallel=bool(settings and settings.vocab_parallel))


def read_latest_tag(load_dir, universal=False):
    return read_tag(load_dir, LATEST_UNIVERSAL if universal else "latest")


def read_saved_state(load_dir, tag):
    """mp_rank_00_model_states.pt: our client state, the pipeline layout and DeepSpeed's sizes."""
    path = os.path.join(load_dir, tag, "mp_rank_00_model_states.pt")
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing: {load_dir}/latest names {tag!r}, which is not a complete "
                              "DeepSpeed checkpoint")
    return safe_load.load(path)


def saved_cp(saved):
    """The context-parallel size a checkpoint was saved with, from its args (None: they record none)."""
    return getattr(saved.get("args"), "context_parallel_size", None)


def _check_model_shape(args, saved_args, load_dir, universal):
    """The same model; under --universal-checkpoint the vocabulary may be padded further (the padding
    follows the TP size), as DeepSpeed's loader adds zero rows."""
    saved = vars(saved_args) if saved_args is not None else {}
    for name in MODEL_ARGS:
        if name not in saved and name not in UNSAVED_MODEL_ARGS:
            continue
        then = saved.get(name, UNSAVED_MODEL_ARGS.get(name))
        if then == getattr(args, name, None):
            continue
        if name == "padded_vocab_size" and universal and args.padded_vocab_size > then:
            continue
        raise CheckpointError(f"checkpoint {load_dir} has {name}={then}, this run has "
                              f"{getattr(args, name, None)}: the models differ"
                              + ("; keep the vocabulary padding (--pad-vocab-size-to)"
                                 if name == "padded_vocab_size" else ""))
    if saved_args is not None:
        _check_experts(moe_config_from_args(saved_args), args.gpt_config.moe, args.num_layers, load_dir)


def _check_experts(saved, mine, num_layers, load_dir):
    """The same experts where the weights live: their count, sizes, layers and the expert bias (the router's
    other options may change, as Megatron lets a fine-tune change them)."""
    if saved is None and mine is None:
        return
    kind = lambda m: "dense" if m is None else f"a mixture of {m.num_experts} experts"  # noqa: E731
    if saved is None or mine is None or saved.num_experts != mine.num_experts:
        raise CheckpointError(f"checkpoint {load_dir} is {kind(saved)}, this run is {kind(mine)}: the models differ")
    for field, flag in (("ffn_hidden_size", "--moe-ffn-hidden-size"),
                        ("shared_expert_intermediate_size", "--moe-shared-expert-intermediate-size"),
                        ("enable_expert_bias", "--moe-router-enable-expert-bias")):
        theirs, ours = getattr(saved, field), getattr(mine, field)
        if field == "ffn_hidden_size" and not theirs:  # Megatron's default: the dense MLP's, which the check above compared
            theirs = ours
        if theirs != ours:
            raise CheckpointError(f"checkpoint {load_dir} has {flag} {theirs}, this run has {ours}: the models differ")
    if layer_pattern(saved.layer_freq, num_layers) != layer_pattern(mine.layer_freq, num_layers):
        raise CheckpointError(f"checkpoint {load_dir} has experts in layers "
                              f"{layer_pattern(saved.layer_freq, num_layers)} (--moe-layer-freq), this run in "
                              f"{layer_pattern(mine.layer_freq, num_layers)}: the models differ")


@dataclasses.dataclass(frozen=True)
class LoadPlan:
    """What of a checkpoint loads into this run.

    weights: always (layer files are named by global layer index, so any pipeline layout loads
    them; universal: from the whole parameters, any TP x PP x DP);
    optimizer: "deepspeed" (the saved ZeRO shards, same layout only), "by_name" (re-cut from
    the shards of every saved rank, same TP size), "universal" (DeepSpeed cuts the whole
    parameters' state, any layout) or None (fresh); lr_scheduler and progress (the iteration,
    the consumed samples and DeepSpeed's step counters) go together; rng: the saved RNG states
    (python, numpy, torch and the TP tracker's) are this rank's own.
    """
    optimizer: str | None
    progress: bool
    reason: str
    universal: bool = False
    rng: bool = True


_SHOWN_ORDER = ("pp", "dp", "placement", "ep", "vocab_parallel", "tp")


def _shown(layout: dict, other: dict = None) -> str:
    """A layout as the log shows it beside `other` ("pp 2, dp 2 x cp 2, placement [[0, 1]], tp 1"): the data axis
    (pipeline_layout's "dp", DP x CP) as DP and CP apart where "cp" gives the CP size, as one number saying so
    where it does not (a checkpoint whose args record none); vocabulary parallelism as on, not its table of
    parameter names; "ep" 1 written out where the other side has an expert-parallel size (pipeline_layout leaves
    1 out)."""
    shown = {**layout, "vocab_parallel": True} if "vocab_parallel" in layout else dict(layout)
    if other is not None and "ep" in other:
        shown.setdefault("ep", 1)
    cp = shown.pop("cp", None)
    if "dp" in shown:
        axis = shown["dp"]
        shown["dp"] = f"{axis // cp} x cp {cp}" if cp and axis and axis % cp == 0 else \
            f"{axis} (DP x CP, the CP size not recorded)"
    ordered = {**{k: shown[k] for k in _SHOWN_ORDER if k in shown}, **shown}
    return ", ".join(f"{k} {v}" if k != "vocab_parallel" else "vocab_parallel on" for k, v in ordered.items())


def _data_axis_alike(saved_layout: dict, layout: dict) -> bool:
    """The same layout for ZeRO's shards: they are cut over the data axis (DP x CP) whatever its split."""
    return {k: v for k, v in saved_layout.items() if k != "cp"} == {k: v for k, v in layout.items() if k != "cp"}


def plan_load(saved_layout, layout, *, finetune, no_load_optim, zero_stage, universal=False, checkpoint=None):
    """`saved_layout`/`layout`: pipeline_layout's dict plus "tp" and "cp" (the CP size; None or absent: not
    recorded), which the reason shows; `checkpoint` (the step folder) names the conversion command in a refusal."""
    saved_tp, tp = saved_layout.get("tp", 1), layout.get("tp", 1)
    change = f"{_shown(saved_layout, layout)} -> {_shown(layout, saved_layout)}"
    same = _data_axis_alike(saved_layout, layout)
    if universal:
        if zero_stage != 1:
            raise CheckpointError(f"--universal-checkpoint loads into ZeRO stage 1 (DeepSpeed's universal loader "
                                  f"for the pipeline engine); this run has ZeRO stage {zero_stage}")
        what = "weights only" if finetune else "weights, lr schedule and iteration" if no_load_optim \
            else "everything"
        return LoadPlan(None if finetune or no_load_optim else "universal", not finetune,
                        f"universal checkpoint, layout {change}: {what}", universal=True,
                        rng=same)
    if saved_tp != tp:
        raise CheckpointError(
            f"checkpoint {checkpoint} was saved with --tensor-model-parallel-size {saved_tp}, this run has {tp}: "
            f"its layer and optimizer files are split {saved_tp} ways. Convert it to a universal checkpoint "
            f"({conversion_command(*os.path.split(checkpoint or 'SAVE/global_stepN'))}) and resume with "
            "--universal-checkpoint")
    if finetune:
        return LoadPlan(None, False, "--finetune: weights only, training starts at iteration 0")
    if no_load_optim:
        return LoadPlan(None, True, "--no-load-optim: weights, lr schedule and iteration; a fresh optimizer")
    if same:
        moved = saved_layout.get("cp") not in (None, layout.get("cp"))
        return LoadPlan("deepspeed", True, "same pipeline layout" + (f" ({change}: the data axis DP x CP alike)"
                                                                     if moved else "") + ": everything")
    if zero_stage != 1:
        raise CheckpointError(
            f"the checkpoint's pipeline layout {_shown(saved_layout, layout)} differs from this run's "
            f"{_shown(layout, saved_layout)}: its "
            f"optimizer state can be re-cut only from ZeRO-1 shards (this run has ZeRO stage {zero_stage}); pass "
            "--no-load-optim to continue with a fresh optimizer, or --finetune to load the weights alone, or "
            "convert it to a universal checkpoint and resume with --universal-checkpoint")
    return LoadPlan("by_name", True, f"pipeline layout {change}: everything, the optimizer state re-cut "
                                     "parameter by parameter")


def load_checkpoint(engine, args):
    """Load args.load if it has a `latest`; returns the training state to resume from.

    {"iteration", "consumed_train_samples", "consumed_valid_samples", "rng_state" (or None), "loaded_tag" (the
    step read, or None: retention never deletes it)}.
    """
    state = {"iteration": 0, "consumed_train_samples": 0, "consumed_valid_samples": 0, "rng_state": None,
             "loaded_tag": None}
    if not args.load:
        return state
    universal = engine.load_universal_checkpoint()
    tag = read_latest_tag(args.load, universal)
    if tag is None:
        print_rank_0(f"Unable to find latest file at {os.path.join(args.load, 'latest')}, "
                     "will not load any checkpoint and will start from random")
        return state
    load_optimizer = not (args.no_load_optim or args.finetune)  # the ZeRO shards are read either way below
    skip = lambda rel: not load_optimizer and "optim_states" in rel  # noqa: E731
    verify_manifest(os.path.join(args.load, tag), skip=skip, warn_missing=not universal)
    safe_load.check_step(os.path.join(args.load, tag), skip=skip)  # no file can run code once loaded
    saved = read_saved_state(args.load, tag)
    _check_model_shape(args, saved.get("args"), args.load, universal)
    saved_tp = getattr(saved.get("args"), "tensor_model_parallel_size", 1)
    plan = plan_load({**saved_layout(saved), "tp": saved_tp, "cp": saved_cp(saved)},
                     {**pipeline_layout(engine), "tp": args.tensor_model_parallel_size,
                      "cp": args.context_parallel_size},
                     finetune=args.finetune, no_load_optim=args.no_load_optim,
                     zero_stage=engine.zero_optimization_stage(), universal=universal,
                     checkpoint=os.path.join(args.load, tag))
    print_rank_0(f"loading checkpoint {tag} from {args.load}: {plan.reason}")
    client_state = restore(engine, args.load, tag, plan)
    state["loaded_tag"] = tag
    if plan.progress:
        state["iteration"] = int(saved.get("iteration", 0))
        state["consumed_train_samples"] = int(saved.get("consumed_train_samples", 0))
        state["consumed_valid_samples"] = int(saved.get("consumed_valid_samples", 0))
        if not args.no_load_rng and plan.rng:
            state["rng_state"] = client_state.get("rng_state")  # this pipeline stage's own file
    print_rank_0(f"  successfully loaded checkpoint from {args.load} at iteration {state['iteration']}")
    return state


def restore(engine, load_dir, tag, plan):
    """Load `tag` into the engine as `plan` says; returns this stage's client state."""
    checkpoint_engine.install(engine)
    vocab = getattr(engine.module, "vocab_slice", None)
    naming = (universal_names(engine.optimizer, vocab) if plan.universal and vocab is not None
              else contextlib.nullcontext())
    with safe_load.weights_only_everywhere(), naming:
        load_path, client_state = engine.load_checkpoint(
            load_dir, tag=tag, load_optimizer_states=plan.optimizer in ("deepspeed", "universal"),
            load_lr_scheduler_states=plan.progress, load_module_only=not plan.progress)
    if load_path is None:
        raise CheckpointError(f"DeepSpeed could not load {tag} from {load_dir}")
    if plan.universal:
        restore_buffers(engine.module, os.path.join(load_dir, tag))
    if plan.universal and plan.optimizer is None:
        fresh_optimizer(engine.optimizer)
    if plan.optimizer == "by_name":
        try:
            saved_names = (client_state.get(LAYOUT_KEY) or {}).get("vocab_parallel")  # the saved layout
            restore_by_name(engine.optimizer, os.path.join(load_dir, tag), saved_names, vocab,
                            engine.grid.get_slice_parallel_rank(), engine.grid.get_slice_parallel_world_size())
        except RelayoutError as e:
            raise CheckpointError(f"checkpoint {load_dir}/{tag}: {e}") from e
    return client_state or {}


def fresh_optimizer(zero):
    """Forget the optimizer state DeepSpeed's universal loader restores with the weights (it always does)."""
    zero.optimizer.state.clear()
    ZeroInternals(zero).relink_hp_optimizer_states()
