"""bench.gloo_posting end to end at toy size: one engine, iterations alternating gloo's receives posted at the start
and one op ahead, the paired table. Structure only - the timings of a loaded test machine prove nothing."""
import math

import pytest

from bench import gloo_posting


@pytest.mark.timeout(600)
def test_gloo_posting_bench_pairs_both_ways(capsys):
    rows = gloo_posting.main(["--pp", "2", "--gas", "4", "--num-layers", "4", "--hidden-size", "32",
                              "--num-attention-heads", "4", "--seq-length", "32", "--vocab-size", "128",
                              "--iterations", "2", "--engines", "zbv"])
    (row,) = rows.values()
    assert list(rows) == ["zbv"] and all(math.isfinite(row[k]) and row[k] > 0 for k in ("start", "ahead", "ratio"))
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| zbv ")]
    assert len(table) == 1 and float(table[0].split("|")[4]) == pytest.approx(row["ratio"], abs=6e-4)
