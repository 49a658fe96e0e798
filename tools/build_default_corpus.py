#!/usr/bin/env python
"""Build a small English corpus offline: `--output PATH.jsonl [--max-docs N]`.

Python's pydoc topics and standard-library docstrings, one JSON line per
document with a "text" key, the same bytes on every run of one Python version.
The logic lives in megatron_ds/data/default_corpus.py.
"""
import sys

from megatron_ds.data.default_corpus import main

if __name__ == "__main__":
    sys.exit(main())
