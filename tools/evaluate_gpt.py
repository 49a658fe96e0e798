#!/usr/bin/env python
"""Loss and perplexity of a megatron_ds checkpoint on held-out text, without training.

    python tools/evaluate_gpt.py --load CKPT_DIR --data-path PREFIX        # a .bin/.idx pair
    python tools/evaluate_gpt.py --load CKPT_DIR --valid-data held_out.jsonl [--json-key text]

One process, the reference GPTModel. The documents form one token stream scored in
windows of --seq-length (default: the run's); --overlapping-eval N moves the window by
N tokens and scores only its last N (Megatron's tasks/zeroshot_gpt LM evaluation).
--eval-max-tokens N scores the first N tokens of the stream only (a large corpus takes minutes per
million tokens on a CPU). A progress bar counts the windows on stderr. Prints the average loss, the
perplexity and the token count; --results-file writes them as JSON.
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
    p.add_argument("--eval-max-tokens", type=int, default=None,
                   help="score the first N target tokens of the stream only (default: all)")
    p.add_argument("--results-file", default=None, help="write {loss, ppl, tokens, windows} as JSON")
    add_tokenizer_override_args(p)
    return p


def evaluate(a):
    from megatron_ds.convert import ToolError
    from megatron_ds.convert.reference import checkpoint_tokenizer, load_checkpoint_model, override_tokenizer_args
    from megatron_ds.inference.perplexity import evaluate_stream, stream_from_indexed, stream_from_jsonl, windows
    model, args, iteration = load_checkpoint_model(a.load)
    seq_length = a.seq_length or args.seq_length
    if not 0 < seq_length <= model.config.max_position_embeddings:
        raise ToolError(f"--seq-length {seq_length} must be in [1, {model.config.max_position_embeddings}] "
                        "(the model's max position embeddings)")
    if a.overlapping_eval is not None and not 0 < a.overlapping_eval <= seq_length:
        raise ToolError(f"--overlapping-eval {a.overlapping_eval} must be in [1, --seq-length {seq_length}]")
    if a.eval_max_tokens is not None and a.eval_max_tokens < 1:
        raise ToolError(f"--eval-max-tokens {a.eval_max_tokens} must be at least 1")
    limit = None if a.eval_max_tokens is None else a.eval_max_tokens + 1  # N targets need N + 1 tokens
    if a.data_path:
        tokens = stream_from_indexed(a.data_path, limit)
    else:
        tokenizer = checkpoint_tokenizer(override_tokenizer_args(args, a.vocab_file, a.merge_file,
                                                                 a.tokenizer_name_or_path))
        tokens = stream_from_jsonl(a.valid_data, tokenizer, a.json_key)[:limit]
    if len(tokens) < 2:
        raise ToolError(f"{a.data_path or a.valid_data}: fewer than 2 tokens, nothing to score")
    from tqdm import tqdm
    stride = a.overlapping_eval or seq_length
    with tqdm(total=len(windows(len(tokens), seq_length, stride)), unit="window", mininterval=2,
              desc=f"scoring {len(tokens) - 1} tokens") as bar:
        result = evaluate_stream(model, tokens, seq_length, stride, a.micro_batch_size, bar.update)
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
