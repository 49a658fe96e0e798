#!/usr/bin/env python
"""Tokenize a JSON-lines corpus (or a Hugging Face dataset) into Megatron .bin/.idx files.

The logic lives in megatron_ds/data/preprocessing/pipeline.py; run with --help for the flags.
"""
import sys

from megatron_ds.data.preprocessing.pipeline import main

if __name__ == "__main__":
    sys.exit(main())
