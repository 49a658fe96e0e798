"""Megatron's packed-document flags: --reset-position-ids, --reset-attention-mask, --eod-mask-loss.

Their meaning is model/documents.py's; they go into the run's GPTConfig (model_args.gpt_config_from_args), and the
tokenizer's end-of-document token joins them when it is built (eod_token: a tokenizer without one is refused,
not silently ignored). What cannot honour them is refused at parse time, one line each. Under a document mask
Seq1F1B's balanced cut weighs the corpus's documents (document_keys).
"""
import os

from megatron_ds.data.tokenizer import TokenizerError

from ..errors import ArgumentsError

FLAGS = ("reset_position_ids", "reset_attention_mask", "eod_mask_loss")


def add_document_args(parser):
    g = parser.add_argument_group("packed documents (Megatron)")
    g.add_argument("--reset-position-ids", action="store_true",
                   help="positions restart at 0 after each end-of-document token (learned positions and RoPE)")
    g.add_argument("--reset-attention-mask", action="store_true",
                   help="a token attends to the earlier tokens of its own document only")
    g.add_argument("--eod-mask-loss", action="store_true",
                   help="the prediction made at an end-of-document token (the next document's first token) is "
                        "not scored")


def _given(args):
    return [f"--{name.replace('_', '-')}" for name in FLAGS if getattr(args, name, False)]


def document_keys(args):
    """Under --reset-attention-mask, where Seq1F1B's balanced cut may be made (a "seq1f1b", "auto" or file
    schedule), the keys a query sees on average in the corpus (data/document_stats.py); else None (causal's)."""
    settings = args.pipeline_settings
    if not args.gpt_config.reset_attention_mask or settings.seq_split_method != "balanced":
        return None
    if settings.schedule not in ("seq1f1b", "auto") and not settings.file:
        return None
    prefixes = args.data_path[-1:] if len(args.data_path or []) == 1 else (args.data_path or [])[1::2]
    if not prefixes or not all(os.path.isfile(p + ".idx") for p in prefixes):
        return None  # _check_data_and_io names what is missing
    from megatron_ds.data.document_stats import document_keys as corpus_keys  # lazy: numpy off a bad flag's path
    return corpus_keys(args.data_path, args.seq_length)


def check_document_args(args):
    """After the ds_config is merged: the engine and the settings that cannot honour the flags."""
    config, settings = args.gpt_config, args.pipeline_settings
    if not config.documents_in_every_stage:
        return
    flag = " and ".join(f for f in _given(args) if f != "--eod-mask-loss")
    if settings.stock and not getattr(args, "hf_model", None):  # a Hugging Face model's stages hand the position ids on (pipe/hf/)
        raise ArgumentsError(f"{flag} with DeepSpeed's own engine (no ds_config \"pipeline.schedule\"): its stages "
                             "after the first see hidden states only, not where documents end; name a schedule "
                             '("schedule": "1f1b" runs its order on our engine)')
    if settings.cuda_graphs:
        raise ArgumentsError(f'{flag} with ds_config "pipeline.cuda_graphs" = true: each micro-batch has its own '
                             "documents, which a replayed graph cannot take; leave the graphs off")


def eod_token(tokenizer, args):
    """The tokenizer's end-of-document id when a document flag is on (else None); one it does not have, or
    outside the vocabulary, is a TokenizerError."""
    given = _given(args)
    if not given:
        return None
    try:
        eod = tokenizer.eod
    except (AttributeError, NotImplementedError):
        eod = None
    if eod is None:
        has = "has none"
    elif not 0 <= eod < args.padded_vocab_size:
        has = f"has as {eod}, outside the vocabulary of {args.padded_vocab_size}"
    else:
        return eod
    raise TokenizerError(f"{' '.join(given)} find documents by the end-of-document token, which the tokenizer "
                         f"({getattr(args, 'tokenizer_type', None)}) {has}; give a tokenizer that has one (an HF "
                         "tokenizer's eos_token)")
