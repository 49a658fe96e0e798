"""--hf-model DIR: train a Hugging Face causal LM (a local folder that transformers' from_pretrained reads) under
our schedules, cut from transformers' own modules (pipe/hf/), instead of our GPT.

The folder's config.json gives the model's sizes (read here, torch-free, so a bad folder fails with the flags):
--num-layers, --hidden-size, --num-attention-heads and --ffn-hidden-size are taken from it, and one given that
disagrees is refused; the tokenizer is the folder's (PretrainedFromHF) unless --tokenizer-name-or-path names
another. The flags that describe our GPT's own layers, and the pipeline features not run for such a model yet
(vocabulary parallelism, tensor parallelism, the universal checkpoint, "auto" with packed documents or context
parallelism, whose candidates and probe cut the sequence into segments; "auto_recompute", whose knob is our GPT's
recompute), are refused; so is
one of --reset-position-ids and --reset-attention-mask without the other (the layers find documents where the
position ids restart: pipe/hf/attention.py). --context-parallel-size runs (pipe/hf/engine.py) under a named
schedule, for a model whose attention has no sliding window shorter than --seq-length and no capped scores (the
context-parallel attention has neither; the folder's config.json says).
"""
import os

from megatron_ds.files import UnreadableFile, read_json

from ..errors import ArgumentsError

SIZES = (("num_layers", "num_hidden_layers"), ("hidden_size", "hidden_size"),
         ("num_attention_heads", "num_attention_heads"), ("ffn_hidden_size", "intermediate_size"))
GPT_ONLY = ("swiglu", "qk_layernorm", "embed_layernorm", "untie_embeddings_and_output_weights",
            "use_rotary_position_embeddings", "loss_chunk_size", "use_liger_kernel", "num_experts",
            "use_rope_scaling", "rope_scaling_type")  # the folder's config.json says its rope_parameters


def add_hf_args(parser):
    g = parser.add_argument_group("Hugging Face model")
    g.add_argument("--hf-model", default=None, metavar="DIR",
                   help="train this Hugging Face causal LM folder (config.json and weights) in place of the GPT; "
                        "its sizes and tokenizer come from the folder; the end of the run saves it (SAVE/hf_iter_N)")


# the keys of families that name their sizes otherwise (GPT-2 and its kin: transformers' attribute_map)
ALIASES = {"num_hidden_layers": "n_layer", "hidden_size": "n_embd", "num_attention_heads": "n_head",
           "intermediate_size": "n_inner", "max_position_embeddings": "n_positions"}


def hf_config(folder):
    """The folder's config.json as a dict (GPT-2's n_layer, n_embd, ... under their usual names too);
    ArgumentsError naming the folder and why."""
    path = os.path.join(folder, "config.json")
    if not os.path.isdir(folder):
        raise ArgumentsError(f"--hf-model {folder}: no such folder")
    try:
        config = read_json(path, f"--hf-model {folder}: config.json")
    except UnreadableFile as exc:
        raise ArgumentsError(str(exc)) from None
    if isinstance(config, dict):
        config = {**{key: config[alias] for key, alias in ALIASES.items() if key not in config and alias in config},
                  **config}
    if not isinstance(config, dict) or not all(isinstance(config.get(key), int) for _, key in SIZES[:3]):
        raise ArgumentsError(f"--hf-model {folder}: config.json does not give num_hidden_layers, hidden_size and "
                             "num_attention_heads (not a transformers model's config)")
    return config


def apply_hf_model(args):
    """With --hf-model: the model's sizes and tokenizer from its folder (written onto args: DERIVED). Without it
    the parser requires the size flags (arguments.build_parser)."""
    if args.hf_model is None:
        return
    config = hf_config(args.hf_model)
    sizes = {}
    for flag, key in SIZES:
        value, given = config.get(key), getattr(args, flag)
        if given is not None and value is not None and given != value:
            raise ArgumentsError(f"--{flag.replace('_', '-')} {given} disagrees with --hf-model's {key} {value} "
                                 "(leave the flag out: the folder gives it)")
        sizes[flag] = given if value is None else value
    args.num_layers, args.hidden_size = sizes["num_layers"], sizes["hidden_size"]
    args.num_attention_heads, args.ffn_hidden_size = sizes["num_attention_heads"], sizes["ffn_hidden_size"]
    args.num_key_value_heads = config.get("num_key_value_heads") or args.num_key_value_heads
    given = [f"--{name.replace('_', '-')}" for name in GPT_ONLY if getattr(args, name, None)]
    if given:
        raise ArgumentsError(f"{given[0]} describes our GPT's layers; with --hf-model the model is the folder's")
    if args.tokenizer_type == "GPT2BPETokenizer" and (args.vocab_file or args.merge_file):
        raise ArgumentsError("--vocab-file/--merge-file with --hf-model: the tokenizer is the folder's "
                             "(or --tokenizer-type PretrainedFromHF --tokenizer-name-or-path)")
    args.tokenizer_type = "PretrainedFromHF"
    args.tokenizer_name_or_path = args.tokenizer_name_or_path or args.hf_model


def check_hf_pipeline(args):
    """What the cut model cannot run, refused at parse time."""
    if args.hf_model is None:
        return
    settings = args.pipeline_settings
    documents = args.reset_position_ids or args.reset_attention_mask
    refused = [("--tensor-model-parallel-size > 1", args.tensor_model_parallel_size > 1),
               ('"schedule": "auto" and packed documents ("auto" weighs and probes Seq1F1B\'s segments)',
                settings.auto and documents),
               ('"schedule": "auto" and --context-parallel-size > 1', settings.auto and args.context_parallel_size > 1),
               ("--cp-comm-type a2a+p2p", args.cp_comm_type == "a2a+p2p" and args.context_parallel_size > 1),
               ('"auto_recompute" (it weighs our GPT\'s recompute settings)', settings.auto_recompute),
               ("vocabulary parallelism", settings.vocab_parallel),
               ("--universal-checkpoint", args.universal_checkpoint)]
    for what, on in refused:
        if on:
            raise ArgumentsError(f"--hf-model with {what}: not run yet for a Hugging Face model (the cut runs "
                                 "pipeline x data parallelism under the named schedules)")
    check_hf_context_parallel(args)
    if args.reset_position_ids != args.reset_attention_mask:
        given, missing = (("--reset-position-ids", "--reset-attention-mask") if args.reset_position_ids
                          else ("--reset-attention-mask", "--reset-position-ids"))
        raise ArgumentsError(f"--hf-model with {given} alone: a Hugging Face model's layers see a new document where "
                             f"the position ids restart, so give {missing} too")


def check_hf_context_parallel(args):
    """--context-parallel-size with --hf-model: what the context-parallel attention cannot do for the folder's model
    (pipe/hf/engine.context_problem checks the model itself again when it is built)."""
    cp = args.context_parallel_size
    if cp == 1:
        return
    if args.pipeline_settings.stock:
        raise ArgumentsError(f"--hf-model with --context-parallel-size {cp} under DeepSpeed's own engine (no "
                             '"pipeline.schedule"): name a schedule ("1f1b" is its order on our engine)')
    config = hf_config(args.hf_model)
    window = config.get("sliding_window") if config.get("use_sliding_window", True) else None
    if isinstance(window, int) and window < args.seq_length:
        raise ArgumentsError(f"--hf-model {args.hf_model} with --context-parallel-size {cp}: its sliding window "
                             f"({window} tokens) is shorter than --seq-length {args.seq_length}, and the "
                             "context-parallel attention has no window")
    if config.get("attn_logit_softcapping"):
        raise ArgumentsError(f"--hf-model {args.hf_model} with --context-parallel-size {cp}: its attention caps the "
                             "scores (attn_logit_softcapping), which the context-parallel attention does not")
