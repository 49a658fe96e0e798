#!/usr/bin/env python
"""Loss and perplexity of a megatron_ds checkpoint on held-out text, without training.

    python tools/evaluate_gpt.py --load CKPT_DIR --data-path PREFIX        # a .bin/.idx pair
    python tools/evaluate_gpt.py --load CKPT_DIR --valid-data held_out.jsonl [--json-key text]

One process, the reference GPTModel. The documents form one token stream scored in
windows of --seq-length (default: the run's); --overlapping-eval N moves the window by
N tokens and scores only its last N (Megatron's tasks/zeroshot_gpt LM evaluation).
Prints the average loss, the perplexity and the token count; --results-file writes them as JSON.
"""
import argparse
import json
import sys

from megatron_ds.convert.cli import add_tokenizer_override_args, run_tool


def build_parser():
    p = argparse.ArgumentParser(prog="evaluate_gpt.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--load", required=True, help="the checkpoint folder (holds `latest`)")
    data = p.add_mutually_exclusive_group(required=True)
    data.add_argument("--data-path", default=None, help="prefix of a Megatron .bin/.idx pair")
    data.add_argument("--valid-data", default=None, help="a JSONL file, one document per line")
    p.add_argument("--json-key", default="text")
    p.add_argument("--seq-length", type=int, default=None, help="window length (default: the run's)")
    p.add_argument("--overlapping-eval", type=int, default=None, help="window stride (default: --seq-length)")
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--results-file", default=None, help="write {loss, ppl, tokens, windows} as JSON")
    add_tokenizer_override_args(p)
    return p


def evaluate(a):
    from megatron_ds.convert import ToolError
    from megatron_ds.convert.reference import checkpoint_tokenizer, load_checkpoint_model, override_tokenizer_args
    from megatron_ds.inference.perplexity import evaluate_stream, stream_from_indexed, stream_from_jsonl
    model, args, iteration = load_checkpoint_model(a.load)
    seq_length = a.seq_length or args.seq_length
    if not 0 < seq_length <= model.config.max_position_embeddings:
        raise ToolError(f"--seq-length {seq_length} must be in [1, {model.config.max_position_embeddings}] "
                        "(the model's max position embeddings)")
    if a.overlapping_eval is not None and not 0 < a.overlapping_eval <= seq_length:
        raise ToolError(f"--overlapping-eval {a.overlapping_eval} must be in [1, --seq-length {seq_length}]")
    if a.data_path:
        tokens = stream_from_indexed(a.data_path)
    else:
        tokenizer = checkpoint_tokenizer(override_tokenizer_args(args, a.vocab_file, a.merge_file,
                                                                 a.tokenizer_name_or_path))
        tokens = stream_from_jsonl(a.valid_data, tokenizer, a.json_key)
    if len(tokens) < 2:
        raise ToolError(f"{a.data_path or a.valid_data}: fewer than 2 tokens, nothing to score")
    result = evaluate_stream(model, tokens, seq_length, a.overlapping_eval, a.micro_batch_size)
    print(f"{a.load} (iteration {iteration}) on {a.data_path or a.valid_data}: avg loss {result['loss']:.6E} | "
          f"ppl {result['ppl']:.6E} | {result['tokens']} tokens in {result['windows']} windows of {seq_length}")
    if a.results_file:
        with open(a.results_file, "w") as f:
            json.dump(result, f)


def main(argv=None):
    p = build_parser()
    return run_tool(p.prog, evaluate, p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
