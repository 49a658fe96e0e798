#!/usr/bin/env python
"""Merge Megatron .bin/.idx datasets in the order given (e.g. shards of one corpus).

The logic lives in megatron_ds/data/preprocessing/merge.py; run with --help for the flags.
"""
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from megatron_ds.data.preprocessing.merge import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
