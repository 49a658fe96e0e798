"""A megatron_ds checkpoint -> a Hugging Face folder (config.json, model.safetensors, tokenizer).

`AutoModelForCausalLM.from_pretrained(OUT)` then builds the family's HF model
(GPT2LMHeadModel for GPT-2) with the checkpoint's weights bit for bit, in the
dtype they were saved in; `AutoTokenizer.from_pretrained(OUT)` the run's tokenizer.
The vocabulary keeps Megatron's padding (config vocab_size = padded size).
"""
from . import ToolError
from .cli import quiet
from .reference import checkpoint_tokenizer, load_checkpoint_model, override_tokenizer_args
from .staging import check_new_folder, staged_folder


def hf_tokenizer(args, tokenizer):
    """The run's tokenizer as a transformers tokenizer."""
    import transformers
    if args.tokenizer_type == "GPT2BPETokenizer":
        return transformers.GPT2Tokenizer(vocab=args.vocab_file, merges=args.merge_file,
                                          model_max_length=args.max_position_embeddings)
    return transformers.AutoTokenizer.from_pretrained(args.tokenizer_name_or_path, local_files_only=True)


def export_hf(load_dir, out_dir, vocab_file=None, merge_file=None, tokenizer_name_or_path=None):
    from transformers import AutoModelForCausalLM
    from megatron_ds.convert.hf import hf_config_from_gpt, to_hf_state_dict  # lazy: torch
    check_new_folder(out_dir)
    model, args, iteration = load_checkpoint_model(load_dir)
    override_tokenizer_args(args, vocab_file, merge_file, tokenizer_name_or_path)
    tokenizer = checkpoint_tokenizer(args)
    config = model.config
    dtype = next(model.parameters()).dtype
    try:
        hf_config = hf_config_from_gpt(config, bos_token_id=tokenizer.eod, eos_token_id=tokenizer.eod, dtype=dtype)
    except ValueError as e:  # model options no Hugging Face family has
        raise ToolError(f"{load_dir}: {e}") from None
    with quiet():
        hf_model = AutoModelForCausalLM.from_config(hf_config).to(dtype)
    hf_model.load_state_dict(to_hf_state_dict(model.named_parameters_by_layer(), config), strict=True)
    with staged_folder(out_dir) as tmp:
        hf_model.save_pretrained(tmp)
        hf_tokenizer(args, tokenizer).save_pretrained(tmp)
    print(f"exported {load_dir} (iteration {iteration}) as {type(hf_model).__name__} ({dtype}) to {out_dir}")
    return hf_model
