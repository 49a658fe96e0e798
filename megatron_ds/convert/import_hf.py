"""A local Hugging Face folder -> a megatron_ds checkpoint that `--load OUT --finetune` continues.

The model flags come from the HF config (through the family's gpt_config_from_hf);
they are checked by parsing them and rebuilding the model config, and the tokenizer
flags by building the tokenizer: its vocabulary, padded, must be the HF model's
vocab_size (by default --pad-vocab-size-to is set to it). The flags are printed and
written to OUT/megatron_ds_args.txt; the folder's tokenizer, if any, is copied to
OUT/tokenizer. Nothing is written unless every check passes.
"""
import os
import shlex

from megatron_ds.data.tokenizer import TokenizerError, build_tokenizer, default_gpt2_files

from . import ToolError
from .cli import quiet
from .ds_format import write_checkpoint
from .hf_folder import has_tokenizer, read_config, read_weights
from .model_args import check_flags_rebuild, config_flags, parse_flags
from .staging import check_new_folder, staged_folder

ARGS_FILE = "megatron_ds_args.txt"


def _model_config(hf_dir):
    from megatron_ds.convert.hf import SUPPORTED, gpt_config_from_hf  # lazy: torch, so --help is quick
    hf_config = read_config(hf_dir)
    if hf_config.model_type not in SUPPORTED:
        archs = ", ".join(getattr(hf_config, "architectures", None) or [])
        raise ToolError(f"{os.path.join(hf_dir, 'config.json')}: model_type {hf_config.model_type!r} ({archs}) "
                        f"is not supported; supported model types: {', '.join(SUPPORTED)}")
    try:
        return gpt_config_from_hf(hf_config)
    except (ValueError, AttributeError) as e:  # an unsupported family, or options our layers lack
        raise ToolError(f"{os.path.join(hf_dir, 'config.json')}: {e}") from None


def _params(hf_dir, config):
    """{(layer, name): tensor}, every parameter of our model found once, with its shape."""
    # lazy: torch
    from megatron_ds.model import GPTModel
    from megatron_ds.convert.hf import from_hf_state_dict
    hf_sd = read_weights(hf_dir)
    try:
        params = from_hf_state_dict(hf_sd, config)
    except ValueError as e:
        raise ToolError(f"{hf_dir}: {e}") from None
    with quiet():
        expected = GPTModel(config).named_parameters_by_layer()
    for key, p in expected.items():
        if key not in params:
            raise ToolError(f"{hf_dir}: no weight maps to layer {key[0]} {key[1]!r}")
        if tuple(params[key].shape) != tuple(p.shape):
            raise ToolError(f"{hf_dir}: layer {key[0]} {key[1]!r} has shape {tuple(params[key].shape)}, "
                            f"config.json's model needs {tuple(p.shape)}")
    return {key: params[key] for key in expected}


def _tokenizer_flags(hf_dir, out_dir, vocab_size, tokenizer_flags):
    """(flags to check the vocabulary with now, flags to write): the folder's own tokenizer moves to OUT."""
    flags = list(tokenizer_flags)
    given = set(flags)
    if not {"--tokenizer-type", "--vocab-file", "--tokenizer-name-or-path"} & given:
        if has_tokenizer(hf_dir):
            flags += ["--tokenizer-type", "PretrainedFromHF", "--tokenizer-name-or-path", hf_dir]
        else:
            vocab, merges = default_gpt2_files()
            flags += ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges]
    if not {"--make-vocab-size-divisible-by", "--pad-vocab-size-to"} & given:
        flags += ["--pad-vocab-size-to", str(vocab_size)]
    final = [os.path.join(out_dir, "tokenizer") if f == hf_dir else f for f in flags]
    return flags, final


def _check_vocab(args, vocab_size, hf_dir, flags):
    where = f"{os.path.join(hf_dir, 'config.json')}: vocab_size {vocab_size}"
    try:
        with quiet():
            tokenizer = build_tokenizer(args)
    except TokenizerError as e:
        raise ToolError(f"{where} does not fit the tokenizer flags {' '.join(flags)}: {e}") from None
    if tokenizer.padded_vocab_size != vocab_size:
        raise ToolError(f"{where} does not fit the tokenizer flags {' '.join(flags)}: the tokenizer has "
                        f"{tokenizer.vocab_size} tokens, padded to {tokenizer.padded_vocab_size}; the embedding "
                        "must have exactly the padded vocabulary")


def import_hf(hf_dir, out_dir, seq_length=None, tokenizer_flags=()):
    """Returns the pretrain_gpt.py flags that continue OUT."""
    hf_dir, out_dir = os.path.abspath(hf_dir), os.path.abspath(out_dir)
    if not os.path.isdir(hf_dir):
        raise ToolError(f"{hf_dir}: no such folder")
    check_new_folder(out_dir)
    config = _model_config(hf_dir)
    params = _params(hf_dir, config)
    model_flags = config_flags(config, seq_length or config.max_position_embeddings)
    check_tok, final_tok = _tokenizer_flags(hf_dir, out_dir, config.vocab_size, tokenizer_flags)
    args = parse_flags(model_flags + check_tok)
    _check_vocab(args, config.vocab_size, hf_dir, check_tok)
    args.padded_vocab_size = config.vocab_size  # the tokenizer pads to exactly it (_check_vocab)
    check_flags_rebuild(model_flags + check_tok, args, config)
    flags = model_flags + final_tok + ["--load", out_dir, "--finetune"]
    saved = parse_flags(model_flags + final_tok)
    saved.padded_vocab_size = config.vocab_size
    line = shlex.join(flags)
    with staged_folder(out_dir) as tmp:
        if final_tok != check_tok:
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
            tokenizer.save_pretrained(os.path.join(tmp, "tokenizer"))
        write_checkpoint(tmp, params, saved)
        with open(os.path.join(tmp, ARGS_FILE), "w") as f:
            f.write(line + "\n")
    print(f"imported {hf_dir} ({config.num_layers} layers, hidden {config.hidden_size}, vocab {config.vocab_size}) "
        f"to {out_dir}\ncontinue it with: pretrain_gpt.py {line} ...  (also in {os.path.join(out_dir, ARGS_FILE)})")
    return flags
