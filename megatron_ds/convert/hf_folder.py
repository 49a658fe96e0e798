"""Reading a local Hugging Face model folder: config.json and the weights (safetensors or .bin, sharded or not)."""
import os

from megatron_ds.files import UnreadableFile, read_json

from . import ToolError

WEIGHT_FILES = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json",
                "pytorch_model.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def read_config(hf_dir):
    from transformers import AutoConfig
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise ToolError(f"{path}: missing (not a Hugging Face model folder)")
    try:
        return AutoConfig.from_pretrained(hf_dir, local_files_only=True)
    except (ValueError, KeyError, OSError) as e:
        raise ToolError(f"{path}: {' '.join(str(e).split())}") from None


def _load_file(path):
    import torch
    if not os.path.isfile(path):
        raise ToolError(f"{path}: missing (a weight file the folder names)")
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file
        return load_file(path)
    return torch.load(path, map_location="cpu", weights_only=True)


def read_weights(hf_dir):
    """{HF name: tensor} of every weight file the folder holds."""
    for name in WEIGHT_FILES:
        path = os.path.join(hf_dir, name)
        if not os.path.isfile(path):
            continue
        if not name.endswith(".index.json"):
            return _load_file(path)
        try:
            shards = sorted(set(read_json(path)["weight_map"].values()))
        except (UnreadableFile, KeyError, TypeError, AttributeError) as exc:
            raise ToolError(f"{path}: not a weight index with a \"weight_map\" ({exc})") from None
        sd = {}
        for shard in shards:
            sd.update(_load_file(os.path.join(hf_dir, shard)))
        return sd
    raise ToolError(f"{hf_dir}: no weight file (looked for {', '.join(WEIGHT_FILES)})")


def has_tokenizer(hf_dir):
    return any(os.path.isfile(os.path.join(hf_dir, n)) for n in TOKENIZER_FILES)
