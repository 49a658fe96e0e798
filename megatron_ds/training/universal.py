"""Resuming under another TP x PP x DP layout through DeepSpeed's universal checkpoint.

A run saves DeepSpeed pipeline checkpoints (checkpointing.py) whose model states carry
`universal_checkpoint_info` (model/universal_info.py); DeepSpeed's converter turns one step
into a folder of whole parameters (fp32 weights, Adam's moments, step) next to it:

    python -m deepspeed.checkpoint.ds_to_universal --input_folder SAVE/global_stepN \\
        --output_folder SAVE/global_stepN_universal

(it also writes SAVE/latest_universal). A run with --universal-checkpoint, or ds_config
"checkpoint": {"load_universal": true} (DeepSpeed's key, which the flag sets), loads that
folder under any layout: DeepSpeed's ZeRO-1 loader cuts each parameter for this rank.

Checked at parse time (no torch): the flag and the key agree, and --load holds a converted
checkpoint; otherwise one message that names the conversion command, exit code 2.
"""
import os

LATEST = "latest_universal"  # DeepSpeed's name: written by ds_to_universal, read by engine.load_checkpoint


def add_universal_args(parser):
    g = parser.add_argument_group("universal checkpoint")
    g.add_argument("--universal-checkpoint", action="store_true",
                   help="load --load's universal checkpoint (converted by deepspeed.checkpoint.ds_to_universal): "
                        "resumes under another tensor-, pipeline- or data-parallel size; sets ds_config "
                        "\"checkpoint\": {\"load_universal\": true}")


def conversion_command(load_dir, tag=None):
    step = os.path.join(load_dir, tag or "global_stepN")
    return (f"python -m deepspeed.checkpoint.ds_to_universal --input_folder {step} "
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
    if not os.path.isfile(state):
        source = tag[:-len("_universal")] if tag.endswith("_universal") else read_tag(load_dir)
        return (f"--universal-checkpoint: {os.path.join(load_dir, tag)} (named by {path}) is not a universal "
                f"checkpoint ({state} is missing); convert the saved step: {conversion_command(load_dir, source)}")
    return ""


def apply_universal(args, ds_config, err):
    """Merge --universal-checkpoint with ds_config "checkpoint.load_universal" (both written back)
    and check the folder; `err` raises the ArgumentsError."""
    section = ds_config.get("checkpoint") or {}
    key = section.get("load_universal")
    if args.universal_checkpoint and key is False:
        err(f"--universal-checkpoint disagrees with ds_config \"checkpoint\": {{\"load_universal\": false}} in "
            f"{args.deepspeed_config}; give one of them")
    args.universal_checkpoint = bool(args.universal_checkpoint or key)
    settings = getattr(args, "pipeline_settings", None)
    if args.universal_checkpoint and settings is not None and settings.vocab_parallel:
        err("--universal-checkpoint with ds_config \"pipeline.vocab_parallel\" = true: DeepSpeed's universal "
            "checkpoint knows no vocabulary slices (its converter refuses a vocabulary-parallel step too); --load "
            "the saved step itself, which resumes under any pipeline or data-parallel size, vocabulary "
            "parallelism on or off")
    if args.universal_checkpoint:
        ds_config["checkpoint"] = {**section, "load_universal": True}
        if not args.load:
            err("--universal-checkpoint (ds_config \"checkpoint.load_universal\") needs --load")
        problem = check_universal_folder(args.load)
        if problem:
            err(problem)
