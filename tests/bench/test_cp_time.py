"""bench.cp_time: the simulated step from measured rates (arithmetic against the ring model worked by hand), and
the bench at toy size: the ring's waits and blocks are counted where they happen. Timings of a loaded test
machine prove nothing, so the run is held to counts and finiteness only."""
import argparse
import math
import statistics

import pytest

from bench import cp_time
from bench.cp_memory import model_config


def _config(seq=512):
    args = argparse.Namespace(vocab_size=512, hidden_size=128, num_layers=2, num_attention_heads=4, kv_heads=2,
                              ffn_hidden_size=352, seq_length=seq)
    return model_config(args, cp_time.CP)


def test_simulated_step_adds_the_rings_exposed_transfer():
    # a layer's forward blocks take 0.2 s: 0.1 s a ring step (backward twice that); a K/V block travels in 0.5 s,
    # its fp32 gradient block (the same bytes in fp32) in 0.5 s. At CP 2 forward exposes 0.5 - 0.1 = 0.4 s;
    # backward's first step (0.2 s) carries the K/V block, its second the first step's gradient block (0.3 s
    # exposed each), and the last gradient block's 0.5 s follows: 1.5 s a layer, 2 layers, 1 micro-batch
    sim = cp_time.simulated(_config(), 512, 1, compute=1.0, kv_transfer=0.5, block_f=0.2)
    assert sim["exposed"] == pytest.approx(3.0) and sim["step"] == pytest.approx(4.0)
    # sent: the K/V block forward, the K/V block and 2 gradient blocks backward (2.0 s); 1.5 s of it exposed
    assert sim["hidden"] == pytest.approx(1 - 1.5 / 2.0)
    fast = cp_time.simulated(_config(), 512, 2, compute=1.0, kv_transfer=1e-9, block_f=0.2)
    assert fast["step"] == pytest.approx(1.0, abs=1e-6)  # nothing to wait for: the compute alone


def test_group_step_is_the_slowest_ranks_against_the_largest_simulated():
    # a quiet run's numbers: rank 0 computes 2.090 s, rank 1 1.965 s, and rank 1 waits for rank 0 in the ring, so
    # both step in ~2.17 s; held to rank 1's own makespan (2.016) it looked 7.6 % off, the group is 2.6 % off
    group = cp_time.group_step([2.167, 2.169], [2.115, 2.016])
    assert group["rank"] == 0 and group["simulated"] == 2.115 and group["measured"] == 2.169
    assert group["off"] == pytest.approx(2.169 / 2.115 - 1) and group["line"].endswith("+2.6% (goal within 5%: met)")
    slow = cp_time.group_step([2.4, 2.4], [2.0, 2.2])  # the largest makespan is rank 1's, 9.1 % under the step
    assert slow["rank"] == 1 and slow["line"].endswith("+9.1% (goal within 5%: NOT met)")


@pytest.mark.timeout(600)
def test_cp_time_bench_at_toy_size_counts_the_rings_waits():
    gas, layers, its = 2, 2, 2
    ranks, sims, group, text = cp_time.main(["--seq-length", "256", "--gas", str(gas), "--num-layers", str(layers),
                                             "--iterations", str(its)])
    for res, sim in zip(ranks, sims):
        # the last step's waits: a K/V block each way per layer and micro-batch, a gradient block per ring step
        assert res["waits"] == {"kv_wait": gas * layers * 2 * (cp_time.CP - 1), "grad_wait": gas * layers * cp_time.CP}
        assert len(res["times"]["overlapped"]) == len(res["times"]["serial"]) == its
        for rings in res["rings"].values():
            assert all(r["block_f"] > 0 and r["block_b"] > 0 for r in rings)  # blocks were attended, both ways
        assert all(math.isfinite(sim[k]) and sim[k] > 0 for k in ("bandwidth", "flops", "step"))
    assert group["simulated"] == max(sim["step"] for sim in sims)
    assert group["measured"] == max(statistics.median(res["times"]["overlapped"]) for res in ranks)
    assert group["line"] in text
    assert text.count("\n| ") == 5  # two rows, the second table's header and two rows
