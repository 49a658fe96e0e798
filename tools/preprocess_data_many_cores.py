#!/usr/bin/env python
"""Tokenize a large corpus with many workers: one shard per worker, merged in input order.

The logic lives in megatron_ds/data/preprocessing/many_cores.py; run with --help for the flags.
"""
import sys

from megatron_ds.data.preprocessing.many_cores import main

if __name__ == "__main__":
    sys.exit(main())
