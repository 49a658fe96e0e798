#!/usr/bin/env python
"""Tokenize a JSON-lines corpus (or a Hugging Face dataset) into Megatron .bin/.idx files.

The logic lives in megatron_ds/data/preprocessing/pipeline.py; run with --help for the flags.
"""
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from megatron_ds.data.preprocessing.pipeline import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
