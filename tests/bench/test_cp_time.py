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


def test_group_step_is_the_slowest_ranks_against_the_coupled_median():
    # the measured group step is its slowest rank's (2.169 s); the coupled simulation's median over three serial
    # steps (2.120 s) is 2.3 % under it; each rank's own makespan (rank 0's 2.115 s the largest) 2.6 %
    group = cp_time.group_step([2.167, 2.169], [2.10, 2.14, 2.12], [2.115, 2.016])
    assert group["measured"] == 2.169 and group["simulated"] == 2.12 and group["rank"] == 0 and group["old"] == 2.115
    assert group["off"] == pytest.approx(2.169 / 2.12 - 1) and group["old_off"] == pytest.approx(2.169 / 2.115 - 1)
    first, second = group["line"].split("\n")
    assert first.endswith("median of 3 steps): +2.3% (goal within 5%: met)")
    assert second.endswith("rank 0's): 2.115 s, measured +2.6%")
    slow = cp_time.group_step([2.4, 2.4], [2.2, 2.0], [2.0, 2.2])  # median 2.1: 14.3 % under the step
    assert slow["rank"] == 1 and "+14.3% (goal within 5%: NOT met)" in slow["line"]


def test_timeline_cuts_a_step_at_its_rings():
    # a step from 0 to 6 s: a forward ring 1-2.5 s (its first step waits 0.1 s for the K/V block, the second takes
    # its block at 1.7), a backward ring 3-5.1 s (step 0 waits 0.1 s for K/V, step 1 from 3.8 s waits 0.2 s for
    # step 0's gradient block and 0.2 s for its own after the last compute)
    marks = [("enter", 1.0, "F"), ("step", 1.1), ("wait", 1.5, 1.6, "kv_wait"), ("step", 1.7), ("exit", 2.5),
             ("enter", 3.0, "B"), ("step", 3.05), ("wait", 3.6, 3.7, "kv_wait"), ("step", 3.8),
             ("wait", 4.5, 4.7, "grad_wait"), ("wait", 4.8, 5.0, "grad_wait"), ("exit", 5.1)]
    line = cp_time.timeline(marks, 0.0, 6.0)
    assert line["outside"] == pytest.approx([1.0, 0.5, 0.9])
    (f, f_steps), (b, b_steps) = line["rings"]
    assert (f, b) == ("F", "B")
    assert f_steps == pytest.approx([0.6, 0.8]) and b_steps == pytest.approx([0.7, 0.9])
    assert line["kv"] == pytest.approx([0.1, 0.1]) and line["grad"] == pytest.approx([0.2, 0.2])


def _timeline(outside, f, b, kv, grad):
    return dict(outside=outside, rings=[("F", f), ("B", b)], kv=kv, grad=grad)


def test_coupled_step_runs_both_ranks_through_their_rings():
    # rank 0 is the faster in forward, rank 1 in backward. The link: K/V (0.25 + 0.25) / 2, the shorter waits of
    # each pair; gradient (0.25 + 0.5) / 2 = 0.375.
    # Forward ring: rank 0 enters at 1, rank 1 at 1.5; the K/V block leaves at 1.5, under both blocks (done 2 and
    # 3.5): they leave at 3 and 5.5. Backward ring: entered at 3.5 and 6; the K/V block leaves at 6 (rank 0, done at
    # 5.5, waits 0.5 s for the post and 0.25 s for the block: 6.25; rank 1 at 7); step 0's gradient block leaves at 7
    # and is there (7.375) before either's second block ends (8.25, 8); the last one leaves at 8.25 (rank 1 waits
    # 0.25 s for the post): 8.625. The step ends with the shorter tail: 8.875
    steps = [_timeline([1.0, 0.5, 0.25], [1.0, 1.0], [2.0, 2.0], kv=[0.25, 0.5], grad=[0.5, 0.5]),
             _timeline([1.5, 0.5, 0.5], [2.0, 2.0], [1.0, 1.0], kv=[0.75, 0.25], grad=[0.25, 0.75])]
    sim = cp_time.coupled_step(steps)
    assert (sim["kv"], sim["grad"]) == (0.25, 0.375) and sim["step"] == 8.875
    assert sim["exposed"] == [0.625, 0.375] and sim["lag"] == [0.5, 0.25] and sim["transfer"] == 1.25
    # each rank's own makespan is 7.75 and 8.5 s (+ its transfers): coupled, the group pays more than either
    steps[1]["rings"] = [("F", [2.0, 2.0])]
    with pytest.raises(ValueError, match="different rings"):
        cp_time.coupled_step(steps)


@pytest.mark.timeout(600)
def test_cp_time_bench_at_toy_size_counts_the_rings_waits():
    gas, layers, its = 2, 2, 2
    ranks, sims, coupled, group, text = cp_time.main(["--seq-length", "256", "--gas", str(gas), "--num-layers",
                                                      str(layers), "--iterations", str(its)])
    for res, sim in zip(ranks, sims):
        # the last step's waits: a K/V block each way per layer and micro-batch, a gradient block per ring step
        assert res["waits"] == {"kv_wait": gas * layers * 2 * (cp_time.CP - 1), "grad_wait": gas * layers * cp_time.CP}
        assert len(res["times"]["overlapped"]) == len(res["times"]["serial"]) == its
        for rings in res["rings"].values():
            assert all(r["block_f"] > 0 and r["block_b"] > 0 for r in rings)  # blocks were attended, both ways
        assert all(math.isfinite(sim[k]) and sim[k] > 0 for k in ("bandwidth", "flops", "step"))
        for line, seconds in zip(res["timelines"]["serial"], res["times"]["serial"]):
            # each layer and micro-batch a forward and a backward ring of CP steps, in the order 1f1b runs them
            kinds = ["F"] * layers + ["B"] * layers
            assert [kind for kind, _ in line["rings"]] == kinds * gas
            assert all(len(c) == cp_time.CP and min(c) > 0 for _, c in line["rings"])
            assert len(line["outside"]) == len(line["rings"]) + 1 and min(line["outside"]) > 0
            assert len(line["kv"]) == gas * layers * 2 * (cp_time.CP - 1)
            # the pieces add up to the step (the timer's own start and end aside)
            total = sum(line["outside"]) + sum(sum(c) for _, c in line["rings"]) + sum(line["kv"]) + sum(line["grad"])
            assert seconds - 0.05 < total <= seconds
    assert len(coupled) == its and all(math.isfinite(c["step"]) and c["step"] > 0 for c in coupled)
    assert group["simulated"] == statistics.median(c["step"] for c in coupled)
    assert group["old"] == max(sim["step"] for sim in sims)
    assert group["measured"] == max(statistics.median(res["times"]["overlapped"]) for res in ranks)
    assert group["line"] in text
    assert text.count("\n| ") == 5  # two rows, the second table's header and two rows
