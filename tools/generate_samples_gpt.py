#!/usr/bin/env python
"""Generate text from a megatron_ds checkpoint on one process (the reference GPTModel).

    python tools/generate_samples_gpt.py --load CKPT_DIR --sample-input-file prompts.txt \\
        --out-seq-length 64 [--greedy | --temperature 0.8 --top_k 40 --top_p 0.9] [--seed 1234]

One prompt per line (stdin without --sample-input-file; "\\n" in a line stands for a
newline). Output (stdout or --sample-output-file): Megatron's "Context:"/"Megatron-LM:"
blocks, or with --output-format jsonl one {"prompt", "text", "tokens"} line per prompt.
Flags as in Megatron-DeepSpeed's tools/generate_samples_gpt.py; --out-seq-length counts
new tokens, capped so the whole sequence fits --seq-length (default: the run's).
"""
import argparse
import contextlib
import json
import os
import sys

from megatron_ds.convert.cli import add_tokenizer_override_args, run_tool


def build_parser():
    p = argparse.ArgumentParser(prog="generate_samples_gpt.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--load", required=True, help="the checkpoint folder (holds `latest`)")
    p.add_argument("--sample-input-file", default=None, help="prompts, one per line (default: stdin)")
    p.add_argument("--sample-output-file", default=None, help="default: stdout")
    p.add_argument("--output-format", choices=["text", "jsonl"], default="text")
    p.add_argument("--out-seq-length", type=int, default=1024, help="new tokens per prompt, at most")
    p.add_argument("--seq-length", type=int, default=None, help="longest sequence (default: the run's)")
    p.add_argument("--greedy", action="store_true")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top_k", "--top-k", dest="top_k", type=int, default=0)
    p.add_argument("--top_p", "--top-p", dest="top_p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=1234)
    add_tokenizer_override_args(p)
    return p


def generate_samples(a):
    import torch
    from megatron_ds.convert import ToolError
    from megatron_ds.convert.reference import checkpoint_tokenizer, load_checkpoint_model, override_tokenizer_args
    from megatron_ds.inference.generation import generate
    if a.temperature <= 0 or not 0.0 <= a.top_p <= 1.0 or a.top_k < 0:
        raise ToolError("--temperature must be > 0, --top_p in [0, 1], --top_k >= 0")
    model, args, _ = load_checkpoint_model(a.load)
    tokenizer = checkpoint_tokenizer(override_tokenizer_args(args, a.vocab_file, a.merge_file,
                                                             a.tokenizer_name_or_path))
    max_length = min(a.seq_length or args.seq_length, model.config.max_position_embeddings)
    if a.sample_input_file and not os.path.isfile(a.sample_input_file):
        raise ToolError(f"--sample-input-file {a.sample_input_file}: no such file")
    with open(a.sample_input_file) if a.sample_input_file else contextlib.nullcontext(sys.stdin) as source:
        prompts = [line.rstrip("\n").replace("\\n", "\n") for line in source]
    contexts = [tokenizer.tokenize(p) if p else [tokenizer.eod] for p in prompts]
    for n, context in enumerate(contexts, 1):
        if len(context) >= max_length:
            raise ToolError(f"prompt {n} has {len(context)} tokens: no room to generate in a {max_length}-token "
                            "sequence (--seq-length)")
    generator = torch.Generator().manual_seed(a.seed)
    with open(a.sample_output_file, "w") if a.sample_output_file else contextlib.nullcontext(sys.stdout) as sink:
        for prompt, context in zip(prompts, contexts):
            tokens = generate(model, context, a.out_seq_length, max_length, eod=tokenizer.eod, greedy=a.greedy,
                              temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, generator=generator)
            text = tokenizer.detokenize(tokens)
            if a.output_format == "jsonl":
                sink.write(json.dumps({"prompt": prompt, "text": text, "tokens": tokens}) + "\n")
            else:
                sink.write(f"Context: {prompt}\n\nMegatron-LM: {text}\n\n")
            sink.flush()


def main(argv=None):
    p = build_parser()
    return run_tool(p.prog, generate_samples, p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
