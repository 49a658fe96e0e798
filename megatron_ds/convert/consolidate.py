"""A checkpoint's weights as one fp32 state dict: what DeepSpeed's zero_to_fp32.py gives its users.

DeepSpeed copies its zero_to_fp32.py into every save folder; it unpickles with weights_only=False and
cannot read a pipeline checkpoint of ours. Ours takes its place (convert/zero_to_fp32.py, written there by
training/checkpoint/recovery_script.py) with the same usage, and calls `main` here:

    python zero_to_fp32.py CHECKPOINT_DIR OUTPUT_DIR [--safe_serialization] [-t TAG]

OUTPUT_DIR/pytorch_model.bin (model.safetensors with --safe_serialization) is the state dict of the
single-process megatron_ds.model.GPTModel (`GPTModel(config).load_state_dict` takes it), every floating
tensor in fp32: the layer files' weights (tensor-parallel shards merged), read weights-only
(training/checkpoint/safe_load.py) after the manifest's sizes and CRC-32s (reference.py). A bf16 or fp16 run saves its
layer files in that dtype; their values are written in fp32 (the fp32 master weights live in the ZeRO shards,
which `python -m megatron_ds.training.checkpoint.universal` writes whole). OUTPUT_DIR and its parents are made when
missing; the file is written to a temporary name and renamed.
"""
import argparse
import os

from megatron_ds.files import write_atomic

from . import ToolError
from .cli import run_tool
from .reference import load_checkpoint_model
from .staging import missing_folders

WEIGHTS = {False: "pytorch_model.bin", True: "model.safetensors"}


def fp32_state_dict(model):
    """{state-dict name: tensor}, floating tensors in fp32, each its own storage (safetensors refuses shared)."""
    import torch
    return {name: (t.to(torch.float32) if torch.is_floating_point(t) else t).detach().clone().contiguous()
            for name, t in model.state_dict().items()}


def _save(state, path, safe_serialization):
    import torch
    if safe_serialization:
        from safetensors.torch import save_file
        write_atomic(path, lambda tmp: save_file(state, tmp, metadata={"format": "pt"}))
    else:
        write_atomic(path, lambda tmp: torch.save(state, tmp))


def consolidate(load_dir, out_dir, tag=None, safe_serialization=False):
    """Write the step's weights; returns the file's path."""
    import torch
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ToolError(f"{out_dir}: not a folder (the output folder)")
    missing_folders(out_dir)  # a parent that is a file: said before minutes of loading
    model, _, iteration = load_checkpoint_model(load_dir, tag)
    saved = next(model.parameters()).dtype
    state = fp32_state_dict(model)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, WEIGHTS[safe_serialization])
    _save(state, path, safe_serialization)
    note = "" if saved == torch.float32 else (
        f"; the checkpoint holds {str(saved).replace('torch.', '')} weights, written here in fp32 (the fp32 "
        "master weights are in the ZeRO shards: python -m megatron_ds.training.checkpoint.universal writes them whole)")
    print(f"wrote {path}: {len(state)} tensors in fp32, the state dict of megatron_ds.model.GPTModel, "
          f"from {load_dir} (iteration {iteration}){note}", flush=True)
    return path


def build_parser():
    p = argparse.ArgumentParser(prog="zero_to_fp32.py", description="The weights of a megatron_ds checkpoint "
                                "as one fp32 state dict (in place of DeepSpeed's zero_to_fp32.py; read "
                                "weights-only). For a Hugging Face folder: tools/checkpoint/export_hf.py.")
    p.add_argument("checkpoint_dir", help="the --save folder (holds `latest` and global_stepN/), e.g. .")
    p.add_argument("output_dir", help="the folder for pytorch_model.bin (or model.safetensors); made if missing")
    p.add_argument("-t", "--tag", default=None, help="the step to read, e.g. global_step1000 (default: the one "
                                                     "`latest` names)")
    p.add_argument("--safe_serialization", action="store_true",
                   help="write model.safetensors instead of pytorch_model.bin (a pickle)")
    return p


def main(argv=None):
    a = build_parser().parse_args(argv)
    return run_tool("zero_to_fp32.py", consolidate, a.checkpoint_dir, a.output_dir, tag=a.tag,
                    safe_serialization=a.safe_serialization)
