#!/usr/bin/env python
"""Blending indices (which dataset each blended sample comes from): our numpy build, the same loaded from
its .npz cache (what every launch after the first does), and megatron-core's C++ helper when importable.

    python -m bench.blending_indices [--sizes 1000000 4000000] [--datasets 3 10 40]

Weights are drawn once per row (fixed seed). Prints seconds (best of 3) and checks that the arrays equal
megatron-core's where it is installed (pip install megatron-core; its helpers_cpp may compile on import).
"""
import argparse
import tempfile
import time

import numpy as np

from megatron_ds.data.blendable_dataset import cached_blending_indices
from megatron_ds.data.helpers import build_blending_indices


def mcore_helper():
    try:
        from megatron.core.datasets import helpers_cpp
    except ImportError:
        try:
            from megatron.core.datasets import helpers as helpers_cpp
        except ImportError:
            return None
    if not hasattr(helpers_cpp, "build_blending_indices"):
        return None

    def build(weights, size):
        dataset_index = np.zeros(size, dtype=np.int16)
        dataset_sample_index = np.zeros(size, dtype=np.int64)
        helpers_cpp.build_blending_indices(dataset_index, dataset_sample_index, weights, len(weights), size, False)
        return dataset_index, dataset_sample_index
    return build


def best_of(fn, repeat=3):
    best, out = None, None
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        seconds = time.perf_counter() - start
        best = seconds if best is None else min(best, seconds)
    return best, out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 4_000_000])
    p.add_argument("--datasets", type=int, nargs="+", default=[3, 10, 40])
    a = p.parse_args()
    mcore = mcore_helper()
    rng = np.random.default_rng(0)
    print(f"| {'datasets':>8s} | {'samples':>10s} | {'ours, build (s)':>15s} | {'ours, cached (s)':>16s} | "
          f"{'megatron-core C++ (s)':>21s} | {'build / C++':>11s} | {'cached / C++':>12s} |")
    print("|" + "|".join("-" * (w + 2) for w in (8, 10, 15, 16, 21, 11, 12)) + "|")
    with tempfile.TemporaryDirectory() as cache:
        for k in a.datasets:
            for size in a.sizes:
                weights = rng.dirichlet(np.ones(k))
                build, ours = best_of(lambda: build_blending_indices(weights, size))
                cached_blending_indices(weights, size, cache)  # writes the cache
                cached, again = best_of(lambda: cached_blending_indices(weights, size, cache))
                assert all(np.array_equal(x, y) for x, y in zip(ours, again))
                if mcore is None:
                    row = f"{'not installed':>21s} | {'-':>11s} | {'-':>12s}"
                else:
                    cpp, theirs = best_of(lambda: mcore(weights, size))
                    assert all(np.array_equal(x, y) for x, y in zip(ours, theirs)), "differs from megatron-core"
                    row = f"{cpp:21.3f} | {build / cpp:10.1f}x | {cached / cpp:11.1f}x"
                print(f"| {k:8d} | {size:10,d} | {build:15.3f} | {cached:16.3f} | {row} |")


if __name__ == "__main__":
    main()
