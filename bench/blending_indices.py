#!/usr/bin/env python
"""Blending indices (which dataset each blended sample comes from): our numpy build, the same loaded from
its .npz cache (what every launch after the first does), and megatron-core's C++ helper when importable.

    python -m bench.blending_indices [--sizes 1000000 4000000] [--datasets 3 10 40]

Weights are drawn once per row (fixed seed). Prints seconds (best of 3) and checks that the arrays equal
megatron-core's where it is installed (pip install megatron-core; its helpers_cpp may compile on import).
"""
import tempfile

import numpy as np

from bench import harness
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


def main(argv=None):
    p = harness.parser(__doc__)
    p.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 4_000_000])
    p.add_argument("--datasets", type=int, nargs="+", default=[3, 10, 40])
    a = p.parse_args(argv)
    out = harness.Report(a.perf_file, "bench.blending_indices", argv)
    mcore = mcore_helper()
    rng = np.random.default_rng(0)
    out(*harness.table(["datasets", "samples", "ours, build (s)", "ours, cached (s)", "megatron-core C++ (s)",
                        "build / C++", "cached / C++"], "rrrrrrr", []))
    with tempfile.TemporaryDirectory() as cache:
        for k in a.datasets:
            for size in a.sizes:
                weights = rng.dirichlet(np.ones(k))
                build, ours = harness.best_of(lambda: build_blending_indices(weights, size), 3)
                cached_blending_indices(weights, size, cache)  # writes the cache
                cached, again = harness.best_of(lambda: cached_blending_indices(weights, size, cache), 3)
                assert all(np.array_equal(x, y) for x, y in zip(ours, again))
                if mcore is None:
                    row = ["not installed", "-", "-"]
                else:
                    cpp, theirs = harness.best_of(lambda: mcore(weights, size), 3)
                    assert all(np.array_equal(x, y) for x, y in zip(ours, theirs)), "differs from megatron-core"
                    row = [f"{cpp:.3f}", f"{build / cpp:.1f}x", f"{cached / cpp:.1f}x"]
                out(harness.row([k, f"{size:,d}", f"{build:.3f}", f"{cached:.3f}", *row]))
    out.save()


if __name__ == "__main__":
    main()
