#!/usr/bin/env python
"""Import a local Hugging Face model folder as a megatron_ds checkpoint.

    python tools/checkpoint/import_hf.py --input HF_DIR --output CKPT_DIR

Prints the pretrain_gpt.py flags that continue it (`--load CKPT_DIR --finetune` and the
model and tokenizer flags) and writes them to CKPT_DIR/megatron_ds_args.txt; add the
batch, schedule and data flags. Tokenizer: the folder's own when it has one, else the
GPT-2 BPE; --pad-vocab-size-to is the model's vocab_size unless a vocabulary flag is given.
Logic: megatron_ds/convert/import_hf.py.
"""
import argparse
import sys

from megatron_ds.convert.cli import run_tool
from megatron_ds.convert.import_hf import import_hf

TOKENIZER_FLAGS = ("--tokenizer-type", "--vocab-file", "--merge-file", "--tokenizer-name-or-path",
                   "--make-vocab-size-divisible-by", "--pad-vocab-size-to")


def main(argv=None):
    p = argparse.ArgumentParser(prog="import_hf.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True, help="a local Hugging Face model folder (config.json + weights)")
    p.add_argument("--output", required=True, help="the checkpoint folder to create")
    p.add_argument("--seq-length", type=int, default=None, help="default: the model's max_position_embeddings")
    for flag in TOKENIZER_FLAGS:
        p.add_argument(flag, default=None, help="as pretrain_gpt.py's")
    a = p.parse_args(argv)
    tokenizer_flags = [x for flag in TOKENIZER_FLAGS if getattr(a, flag[2:].replace("-", "_")) is not None
                       for x in (flag, str(getattr(a, flag[2:].replace("-", "_"))))]
    return run_tool(p.prog, import_hf, a.input, a.output, seq_length=a.seq_length, tokenizer_flags=tokenizer_flags)


if __name__ == "__main__":
    sys.exit(main())
