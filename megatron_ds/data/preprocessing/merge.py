"""tools/merge_preprocessed_data.py: concatenate datasets in the order given.

Merging the shards of a contiguous split of the input reproduces, byte for
byte, the dataset made from the whole input (doc_idx is offset, pointers are
recomputed from sizes, tokens are copied).
"""
import argparse
import os
import sys
import time

from ..indexed_dataset import IndexedDatasetError, MMapIndexedDataset, make_builder


def merge(datasets, output_prefix, log=print):
    if not datasets:
        raise IndexedDatasetError("no datasets to merge")
    out_abs = os.path.abspath(output_prefix)
    if any(os.path.abspath(d) == out_abs for d in datasets):
        raise IndexedDatasetError(f"--output-prefix {output_prefix} is also one of the inputs")
    out_dir = os.path.dirname(out_abs)
    if not os.path.isdir(out_dir):
        raise IndexedDatasetError(f"--output-prefix {output_prefix}: directory {out_dir} does not exist")
    # Open every input first: a bad one fails before anything is written.
    opened = [MMapIndexedDataset(d, skip_warmup=True) for d in datasets]
    for d, ds in zip(datasets, opened):
        if ds.dtype != opened[0].dtype:
            raise IndexedDatasetError(f"{d}.idx: dtype {ds.dtype} differs from {datasets[0]}.idx ({opened[0].dtype})")
    start = time.time()
    log(f"Merging {list(datasets)}")
    log(f"Output prefix: {output_prefix}")
    builder = make_builder(output_prefix + ".bin", "mmap", dtype=opened[0].dtype)
    total = 0
    try:
        for d, ds in zip(datasets, opened):
            total += len(ds)
            log(f"    concat {d} size={len(ds)} for a total size of {total}")
            builder.merge_file_(d)
        builder.finalize(output_prefix + ".idx")
    except BaseException:
        builder.abort()
        raise
    log(f"Time to merge: {time.time() - start:.2f} s")
    log(f"Merged {len(datasets)} datasets to {output_prefix}")
    return total


def main(argv=None):
    p = argparse.ArgumentParser(description="Merge Megatron .bin/.idx datasets, in the order given.")
    p.add_argument("--datasets", nargs="+", required=True,
                   help="dataset prefixes (paths without .bin/.idx)")
    p.add_argument("--output-prefix", required=True, help="writes {prefix}.bin and {prefix}.idx")
    p.add_argument("--merge", choices=("serial",), default="serial")
    args = p.parse_args(argv)
    try:
        merge(args.datasets, args.output_prefix)
    except (IndexedDatasetError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return IndexedDatasetError.exit_code
    return 0
