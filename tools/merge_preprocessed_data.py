#!/usr/bin/env python
"""Merge Megatron .bin/.idx datasets in the order given (e.g. shards of one corpus).

The logic lives in megatron_ds/data/preprocessing/merge.py; run with --help for the flags.
"""
import sys

from megatron_ds.data.preprocessing.merge import main

if __name__ == "__main__":
    sys.exit(main())
