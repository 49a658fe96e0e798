#!/usr/bin/env python
"""Export a megatron_ds checkpoint as a Hugging Face folder.

    python tools/checkpoint/export_hf.py --load CKPT_DIR --output HF_DIR

CKPT_DIR is a pretrain_gpt.py --save folder (any schedule, pipeline and data-parallel
size); its `latest` step is exported. HF_DIR (new) gets config.json,
model.safetensors and the run's tokenizer, for AutoModelForCausalLM / AutoTokenizer.
Logic: megatron_ds/convert/export_hf.py.
"""
import argparse
import sys

from megatron_ds.convert.cli import add_tokenizer_override_args, run_tool
from megatron_ds.convert.export_hf import export_hf


def main(argv=None):
    p = argparse.ArgumentParser(prog="export_hf.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--load", required=True, help="the checkpoint folder (holds `latest`)")
    p.add_argument("--output", required=True, help="the Hugging Face folder to create")
    add_tokenizer_override_args(p)
    a = p.parse_args(argv)
    return run_tool(p.prog, export_hf, a.load, a.output, vocab_file=a.vocab_file, merge_file=a.merge_file,
                    tokenizer_name_or_path=a.tokenizer_name_or_path)


if __name__ == "__main__":
    sys.exit(main())
