"""Resuming under another TP x PP x DP layout through DeepSpeed's universal checkpoint.

A run saves DeepSpeed pipeline checkpoints (save_load.py) whose model states carry
`universal_checkpoint_info` (model/universal_info.py); DeepSpeed's converter turns one step
into a folder of whole parameters (fp32 weights, Adam's moments, step) next to it, through this
module, which takes DeepSpeed's converter's arguments:

    python -m megatron_ds.training.checkpoint.universal --input_folder SAVE/global_stepN \\
        --output_folder SAVE/global_stepN_universal

(it also writes SAVE/latest_universal). It runs DeepSpeed's converter (ds_to_universal), then,
for a step saved under vocabulary parallelism, puts the whole word embedding and output layer in
the place of the slices that converter cannot tell apart (every pipeline rank's has one name: it
extracts rank 0's, universal_info) and names every parameter as the layout without vocabulary
parallelism does, so the folder is the one a plain run's step converts into. A run with --universal-checkpoint, or ds_config
"checkpoint": {"load_universal": true} (DeepSpeed's key, which the flag sets), loads that
folder under any layout: DeepSpeed's ZeRO-1 loader cuts each parameter for this rank (under
vocabulary parallelism each slice's rows: pipe/vocab/vocab_checkpoint.universal_names).

Checked at parse time (no torch): the flag and the key agree, and --load holds a converted
checkpoint; otherwise one message that names the conversion command, exit code 2.
"""
import glob
import os
import sys

SLICE_ATTR = "vocab_slice"  # model/vocab_slices.ATTR (that module needs torch; this one is read at parse time)
LATEST = "latest_universal"  # DeepSpeed's name: written by ds_to_universal, read by engine.load_checkpoint


def add_universal_args(parser):
    g = parser.add_argument_group("universal checkpoint")
    g.add_argument("--universal-checkpoint", action="store_true",
                   help="load --load's universal checkpoint (converted by deepspeed.checkpoint.ds_to_universal): "
                        "resumes under another tensor-, pipeline- or data-parallel size; sets ds_config "
                        "\"checkpoint\": {\"load_universal\": true}")


def conversion_command(load_dir, tag=None):
    step = os.path.join(load_dir, tag or "global_stepN")
    return (f"python -m megatron_ds.training.checkpoint.universal --input_folder {step} "
            f"--output_folder {step}_universal")


def read_tag(load_dir, pointer="latest"):
    """The tag a pointer file (`latest`, `latest_universal`) of load_dir names; None when it is missing."""
    path = os.path.join(load_dir, pointer)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return f.read().strip()


def check_universal_folder(load_dir):
    """'' when load_dir holds a converted checkpoint, else what is wrong and the command that fixes it."""
    path, tag = os.path.join(load_dir, LATEST), read_tag(load_dir, LATEST)
    if tag is None:
        return (f"--universal-checkpoint: {load_dir} holds no universal checkpoint ({path} is missing); "
                f"convert the saved step first: {conversion_command(load_dir, read_tag(load_dir))}")
    state = os.path.join(load_dir, tag, "zero", "optimizer_state.pt")
    source = tag[:-len("_universal")] if tag.endswith("_universal") else read_tag(load_dir)
    if not os.path.isfile(state):
        return (f"--universal-checkpoint: {os.path.join(load_dir, tag)} (named by {path}) is not a universal "
                f"checkpoint ({state} is missing); convert the saved step: {conversion_command(load_dir, source)}")
    if os.path.isdir(os.path.join(load_dir, tag, "zero", f"{SLICE_ATTR}.wte")):
        return (f"--universal-checkpoint: {os.path.join(load_dir, tag)} holds one pipeline rank's vocabulary slice "
                f"for the whole word embedding (DeepSpeed's converter alone ran on a vocabulary-parallel step); "
                f"convert the saved step again: {conversion_command(load_dir, source)}")
    return ""


def apply_universal(args, ds_config, err) -> bool:
    """--universal-checkpoint merged with ds_config "checkpoint.load_universal" (the ds_config takes the merged
    value; the flag's, returned, is the parser's to write) and the folder checked; `err` raises the ArgumentsError."""
    section = ds_config.get("checkpoint") or {}
    key = section.get("load_universal")
    if args.universal_checkpoint and key is False:
        err(f"--universal-checkpoint disagrees with ds_config \"checkpoint\": {{\"load_universal\": false}} in "
            f"{args.deepspeed_config}; give one of them")
    universal = bool(args.universal_checkpoint or key)
    if universal:
        ds_config["checkpoint"] = {**section, "load_universal": True}
        if not args.load:
            err("--universal-checkpoint (ds_config \"checkpoint.load_universal\") needs --load")
        problem = check_universal_folder(args.load)
        if problem:
            err(problem)
    return universal


BUFFERS_KEY = "persistent_buffers"  # in the client state of every mp_rank_XX_model_states.pt


def persistent_buffers(module) -> dict:
    """{pipeline name: tensor} of this stage's state-dict entries that are not parameters (a MoE router's expert
    bias): DeepSpeed's universal loader restores parameters alone, from their ZeRO state, and its converter
    copies the model states files, which so carry these."""
    params = {name for name, _ in module.named_parameters()}
    return {name: t.detach().cpu().clone() for name, t in module.state_dict().items() if name not in params}


def restore_buffers(module, step_dir):
    """Under --universal-checkpoint: this stage's persistent buffers from the step's model states files (any
    stage's file may hold them: the layout may differ)."""
    # lazy: the checkpoint readers; the flag checks in this module run at parse time, torch-free
    from . import safe_load
    from ..errors import CheckpointError
    wanted = persistent_buffers(module)
    if not wanted:
        return
    saved = {}
    for path in sorted(glob.glob(os.path.join(step_dir, "mp_rank_*_model_states.pt"))):
        saved.update(safe_load.load(path).get(BUFFERS_KEY) or {})
    missing = sorted(set(wanted) - set(saved))
    if missing:
        raise CheckpointError(f"{step_dir} holds no value for {', '.join(missing[:3])}"
                              f"{' ...' if len(missing) > 3 else ''} (its model states record no persistent "
                              "buffers: saved by an older version); resume from the step itself with --load")
    state = module.state_dict()
    for name in wanted:
        state[name].copy_(saved[name])


def merge_vocab_slices(step_dir, output_folder, names):
    """Turn DeepSpeed's conversion of a vocabulary-parallel step into a plain step's: each slice's folder
    (pipeline rank 0's rows, DeepSpeed's metadata and step) takes the whole parameter's fp32 weights and
    Adam moments, joined from every model-parallel shard by name in index order (zero_relayout.gather_by_name:
    slice j TP + t is shard j TP + t), and every parameter takes its name without vocabulary parallelism
    (`names`: the step's whole_names)."""
    # lazy: torch and the checkpoint readers; the flag checks in this module run at parse time, torch-free
    import torch
    from deepspeed.checkpoint.constants import PARAM
    from megatron_ds.model.vocab_slices import whole_name
    from . import safe_load
    from .relayout import gather_by_name
    whole, _, _ = gather_by_name(step_dir, names, only=set(names["slices"].values()))  # the slices' state alone
    zero = os.path.join(output_folder, "zero")
    for sliced, name in names["slices"].items():
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            path = os.path.join(zero, sliced, f"{key}.pt")
            state = safe_load.load(path)
            state[PARAM] = whole[name][key].view(-1, *state[PARAM].shape[1:]).clone()
            torch.save(state, path)
    for folder in os.listdir(zero):
        name = whole_name(folder, names)
        if name != folder:
            os.rename(os.path.join(zero, folder), os.path.join(zero, name))


def convert(argv=None) -> int:
    """DeepSpeed's ds_to_universal on --input_folder (its arguments), then the vocabulary slices merged.
    Returns the exit code: 2, with one line on stderr, for a folder that holds no readable step."""
    # lazy: DeepSpeed, torch and the engine; the flag checks in this module run at parse time, torch-free
    from deepspeed.checkpoint import ds_to_universal
    from megatron_ds.pipe.engine import saved_layout
    from . import safe_load
    from ..errors import CheckpointError
    given = sys.argv
    sys.argv = given if argv is None else [given[0], *argv]
    try:
        ds_args = ds_to_universal.parse_arguments()  # reads sys.argv alone
    finally:
        sys.argv = given
    step = ds_args.input_folder
    states = os.path.join(step, "mp_rank_00_model_states.pt")
    try:
        if not os.path.isfile(states):
            raise CheckpointError(f"--input_folder {step} holds no checkpoint step ({states} is missing); give "
                                  "one step folder, SAVE/global_stepN")
        names = (saved_layout(safe_load.load(states)) or {}).get("vocab_parallel")
    except Exception as exc:  # noqa: BLE001 - a damaged file fails in torch's reader, in one of many ways
        why = exc if isinstance(exc, CheckpointError) else f"{states} cannot be read ({type(exc).__name__}: {exc})"
        print(f"python -m megatron_ds.training.checkpoint.universal: error: {why}", file=sys.stderr, flush=True)
        return 2
    ds_to_universal.main(ds_args)
    if names:
        merge_vocab_slices(step, ds_args.output_folder, names)
    return 0


if __name__ == "__main__":
    raise SystemExit(convert())
