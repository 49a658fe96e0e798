"""Benchmarks: each module prints tables; run from the repository root as `python -m bench.NAME`."""
