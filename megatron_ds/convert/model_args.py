"""Between pretrain_gpt.py's arguments and a GPTConfig, both ways.

A checkpoint holds the arguments of the run that saved it; the model comes back
from them through the training code's own model_config(). An imported model goes
the other way: its GPTConfig becomes the flags that rebuild it, and the flags are
checked by parsing them and rebuilding the config (so a field without a flag
cannot slip through unnoticed).
"""
import argparse
import dataclasses

from megatron_ds.gpt_config import config_problem
from megatron_ds.training.config.arguments import build_parser
from megatron_ds.training.errors import ArgumentsError
from megatron_ds.training.config.model_args import (MODEL_FAMILY_ARGS, gpt_config_from_args, model_family_flags,
                                             validate_model_args)

from . import ToolError

# GPTConfig fields that are no model flags: the vocabulary comes from the tokenizer
# (padded to --pad-vocab-size-to), the seed only draws initial weights.
_NOT_FLAGS = ("vocab_size", "seed")
_FAMILY = MODEL_FAMILY_ARGS + ("moe",)  # model_family_flags writes them (the experts: moe_args.moe_flags)
_ALWAYS = ("num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings", "ffn_hidden_size",
           "hidden_dropout", "attention_dropout")


def _actions():
    return {a.dest: a for a in build_parser()._actions if a.option_strings}


def with_defaults(saved):
    """A saved Namespace completed with today's defaults (flags added since it was saved)."""
    args = {dest: a.default for dest, a in _actions().items()}
    args.update(vars(saved))
    return argparse.Namespace(**args)


def config_from_args(args):
    return gpt_config_from_args(args)


def _flag(actions, name, value):
    action = actions.get(name)
    if action is None:
        raise ToolError(f"GPTConfig.{name}={value!r} has no pretrain_gpt.py flag "
                        f"(--{name.replace('_', '-')} is unknown)")
    if isinstance(action, argparse._StoreTrueAction):
        return [action.option_strings[0]] if value else []
    if isinstance(action, argparse._StoreFalseAction):
        return [] if value else [action.option_strings[0]]
    if isinstance(value, (tuple, list)) and action.nargs is not None:  # --hierarchical-context-parallel-sizes A P
        return [action.option_strings[0], *map(str, value)]
    return [action.option_strings[0], str(value)]


def config_flags(config, seq_length):
    """pretrain_gpt.py flags that build `config` (with the tokenizer's padded vocabulary): the sizes and
    dropouts always, the other GPT-2 options where they differ from the flags' defaults, then the family
    options and the experts (training.config.model_args.model_family_flags)."""
    actions = _actions()
    flags = ["--seq-length", str(seq_length)]
    for name in _ALWAYS:
        flags += _flag(actions, name, getattr(config, name))
    plain = parse_flags(flags)
    plain.padded_vocab_size = config.vocab_size
    default = config_from_args(plain)
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if field.name not in _NOT_FLAGS + _ALWAYS + _FAMILY and value != getattr(default, field.name):
            flags += _flag(actions, field.name, value)
    return flags + model_family_flags(config)


def parse_flags(flags):
    """The Namespace pretrain_gpt.py makes of `flags` (parsing only: no world size, no ds_config)."""
    args = build_parser().parse_args(flags)
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    try:
        validate_model_args(args)  # resolves the family flags' aliases, as pretrain_gpt.py does
    except ArgumentsError as e:
        raise ToolError(f"the flags {' '.join(flags)}: {e}") from None
    if config_problem(args):  # the model's own rules, which pretrain_gpt.py checks as it builds the config
        raise ToolError(f"the flags {' '.join(flags)}: {config_problem(args)}")
    return args


def check_flags_rebuild(flags, args, config):
    """`args` (parsed from `flags`, vocabulary padded) must give back exactly `config`."""
    rebuilt = config_from_args(args)
    diff = [f"{f.name}: {getattr(rebuilt, f.name)!r} != {getattr(config, f.name)!r}" for f in dataclasses.fields(config)
            if f.name != "seed" and getattr(rebuilt, f.name) != getattr(config, f.name)]
    if diff:
        raise ToolError(f"the flags {' '.join(flags)} do not rebuild the model: {'; '.join(diff)}")
