#!/usr/bin/env python
"""Tokenize a large corpus with many workers: one shard per worker, merged in input order.

The logic lives in megatron_ds/data/preprocessing/many_cores.py; run with --help for the flags.
"""
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from megatron_ds.data.preprocessing.many_cores import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
