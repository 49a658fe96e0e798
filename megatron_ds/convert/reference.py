"""The single-process reference GPTModel and tokenizer of a checkpoint (no process group)."""
from megatron_ds.data.tokenizer import TokenizerError, build_tokenizer

from . import ToolError
from .cli import quiet
from .ds_format import checkpoint_tag_dir, load_into, read_saved_args
from .model_args import config_from_args, with_defaults


def load_checkpoint_model(load_dir, tag=None):
    """(GPTModel in eval mode holding the checkpoint's weights, the run's arguments, iteration) of step `tag`
    (default: the one `latest` names)."""
    tag_dir = checkpoint_tag_dir(load_dir, tag)
    saved, iteration = read_saved_args(tag_dir)
    from megatron_ds.model import GPTModel  # lazy: torch, so the tools' --help is quick
    args = with_defaults(saved)
    model = load_into(GPTModel(config_from_args(args)), tag_dir)
    return model.eval(), args, iteration


def override_tokenizer_args(args, vocab_file=None, merge_file=None, tokenizer_name_or_path=None):
    """Point the saved tokenizer flags at files that exist here (the run's may have moved)."""
    if vocab_file or merge_file:
        args.tokenizer_type, args.vocab_file, args.merge_file = "GPT2BPETokenizer", vocab_file, merge_file
    if tokenizer_name_or_path:
        args.tokenizer_type, args.tokenizer_name_or_path = "PretrainedFromHF", tokenizer_name_or_path
    return args


def checkpoint_tokenizer(args):
    """The run's tokenizer (megatron_ds.data.tokenizer); its padded vocabulary must be the model's."""
    import copy
    probe = copy.copy(args)
    probe.rank = 0
    try:
        with quiet():  # keep stdout for the tool's own output
            tokenizer = build_tokenizer(probe)
    except TokenizerError as e:
        raise ToolError(f"the checkpoint's tokenizer: {e} (give the files with --vocab-file/--merge-file "
                        "or --tokenizer-name-or-path)") from None
    if tokenizer.padded_vocab_size != args.padded_vocab_size:
        raise ToolError(f"the tokenizer pads to {tokenizer.padded_vocab_size} tokens, the checkpoint's embedding has "
                        f"{args.padded_vocab_size}: not the tokenizer the run used")
    return tokenizer
