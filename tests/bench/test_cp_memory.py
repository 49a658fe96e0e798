"""bench.cp_memory: the simulator's prediction it prints beside the measurement (pure arithmetic), the report's
ratios and verdicts on recorded numbers, and one tiny launch (Seq1F1B at PP 2 x CP 2: kept activations, the K/V
cache and the ring's blocks at once), whose byte counts are deterministic and so can be held to the simulator."""
import argparse

import pytest

from bench import cp_memory

MB = cp_memory.MB


def _args(seq=1024, layers=2, gas=4):
    return argparse.Namespace(vocab_size=512, hidden_size=128, num_layers=layers, num_attention_heads=4, kv_heads=2,
                              ffn_hidden_size=352, seq_length=seq, gas=gas, splits=2, method="even")


def _config(cp, seq=1024):
    return cp_memory.model_config(_args(seq), cp)


def test_predicted_cp2_holds_half_of_cp1_the_rings_blocks_inside_it():
    from megatron_ds.schedules.context_parallel import ContextRun
    one, two = (cp_memory.predicted(_config(cp), 1024, cp, 2, 4) for cp in (1, 2))
    # every kept activation and the logits are per token: half at CP 2; the ring's blocks (a K/V block and three
    # fp32 gradient blocks while B runs at CP 2) live while a layer attends backward, when the B has freed the
    # logits and that layer's MLP part, more than the blocks: the whole peak is the kept one
    in_flight = ContextRun(_config(2), 1024, 2, "p2p", dtype_bytes=4).layer()[0].in_flight[1]
    assert 0 < in_flight and two == pytest.approx(one / 2, rel=1e-9)
    kept = cp_memory.predicted(_config(2), 1024, 2, 2, 4, in_flight=False)  # what a saved-tensor count can see
    assert kept == pytest.approx(one / 2, rel=1e-9)
    block = 1024 // 2 * 2 * 64 * 4  # a rank's 512 tokens of K and V (2 heads of 32), fp32
    assert cp_memory.simulated_ring(_config(2), 1024, 2) == in_flight == 4 * block


def test_predicted_seq1f1b_follows_the_segments_held():
    from megatron_ds.schedules.context_parallel import ContextRun
    # PP 2 (one layer a stage), k = 4 even segments of 128 local tokens: rank 0 holds p - r - 1 + k = 5 segments
    # at its peak, each its layer's kept bytes and K/V cache, and one more segment's cache (an earlier micro-batch's,
    # freed when the segment before it opens backward)
    kept = cp_memory.predicted(_config(2), 1024, 2, 2, 4, 4, [256] * 4, in_flight=False)
    mem = ContextRun(_config(2), 1024, 2, "p2p", dtype_bytes=4).layer(768, 256, True)[0]
    assert kept == pytest.approx(5 * (mem.kept + mem.cache) + mem.cache, rel=1e-12)
    # a segment's layer keeps the whole sequence's per token but c_attn's output and the rotated k (128 + 3 x 64
    # values a token), whose copies the cache (2 x 64) holds
    whole = ContextRun(_config(1), 1024, 1, "p2p", dtype_bytes=4).layer()[0]
    assert mem.kept == whole.kept / 8 - 320 * 128 * 4 and mem.cache == 128 * 128 * 4
    one = cp_memory.predicted(_config(1), 1024, 1, 2, 4)  # 1F1B at CP 1: two whole micro-batches (no logits on rank 0)
    assert one == pytest.approx(2 * whole.kept, rel=1e-12)
    seg = cp_memory.predicted(_config(2), 1024, 2, 2, 4, 4, [256] * 4)
    assert kept < seg < kept + mem.in_flight[1]  # segment 3's blocks beyond what its BW frees before them


def _recorded(kept, ring, with_ring, sim_kept, sim_ring, sim):
    """One run's measure() entry from MB figures (two stages, the first the peak)."""
    stage = dict(saved=kept * MB, kv=0.0, rss_growth=0.0, lengths=[])
    return dict(k=1, stages=[stage, dict(stage, saved=kept * MB / 2)], peak=kept * MB, ring=ring * MB,
                with_ring=with_ring * MB, kept=sim_kept * MB, ring_sim=sim_ring * MB, predicted=sim * MB)


def test_report_computes_each_goal_from_recorded_numbers():
    results = {("1f1b", 1): _recorded(200.0, 0.0, 200.0, 190.0, 0.0, 190.0),
               ("1f1b", 2): _recorded(105.0, 8.0, 108.0, 100.0, 8.0, 110.0),
               ("seq1f1b", 2): dict(_recorded(62.0, 8.0, 64.0, 60.0, 8.0, 71.5), k=4)}
    rows, goals = cp_memory.report(4, results)
    assert [row[5] for row in rows] == ["1.000", "0.525", "0.310"]  # kept peak over 1F1B at CP 1's
    assert [row[7] for row in rows] == ["+5.3%", "+5.0%", "+3.3%"] and [row[11] for row in rows] == \
        ["+5.3%", "-1.8%", "-10.5%"]
    assert "1f1b CP2 / CP1 = 0.525 (<= 0.55: met)" in goals
    assert "seq1f1b k=4 CP2 / 1f1b CP1 = 0.310 (<= 0.3: NOT met; rank 0's theory (4-1+4)/(4x4)/2 = 0.219)" in goals
    assert goals.endswith("off by at most 5.3% kept, 10.5% with the ring (within 10%: met, NOT met)")


@pytest.mark.timeout(600)
def test_one_tiny_launch_counts_what_the_simulator_counts():
    args = _args(seq=128, gas=2)
    pipeline = {"schedule": "seq1f1b", "seq_splits": 2, "seq_split_method": "even"}
    stages = cp_memory.run(args, 2, 2, pipeline, fresh=False)
    assert [s["stage"] for s in stages] == [0, 1] and stages[0]["lengths"] == [64, 64]
    shape = (_config(2, 128), 128, 2, 2, 2, 2, [64, 64])
    kept, ring = cp_memory.predicted(*shape, in_flight=False), cp_memory.simulated_ring(*shape[:3], 2, [64, 64])
    peak = max(s["saved"] for s in stages)
    assert peak == pytest.approx(kept, rel=0.10)  # the layers' saved tensors, the logits and the K/V cache
    # to the byte, on stage 0 (its one layer, p - 1 + k = 3 segments of 32 local tokens held at its peak): the
    # simulator's count, the embedding's token ids (int64) and, as at CP 1, one pair of RoPE tables per segment
    # start (cos and sin of the rank's 32 positions, 2 x 32 x 32 x 4 bytes), cached: every layer and micro-batch
    # rotates by it. A copy of the ring's output for the output projection (q width 128 x 32 x 4 bytes a
    # segment) or an op's own tables would show here
    assert stages[0]["saved"] == kept + 2 * (2 * 32 * 32 * 4) + 3 * 32 * 8 == 1018880
    # the ring's blocks at their longest (the last segment: the whole local cache), a K/V block and three fp32
    # gradient blocks, byte for byte
    assert max(s["ring"] for s in stages) == ring == 128 // 2 * 2 * 64 * 4 * 4
    assert all(s["kv"] > 0 for s in stages)  # each stage's K/V cache counted
    assert all(s["saved"] <= s["with_ring"] <= s["saved"] + s["ring"] for s in stages)


def test_replay_computes_the_simulators_columns_on_recorded_measurements(tmp_path, capsys):
    import json

    def stage(s, saved, lengths=()):
        return dict(stage=s, saved=saved * MB, kv=0.0, ring=8 * MB, with_ring=saved * MB, rss_growth=0.0,
                    lengths=list(lengths))
    runs = {"1f1b/1": {"k": 1, "stages": [stage(0, 40.0), stage(1, 30.0)]},
            "1f1b/2": {"k": 1, "stages": [stage(0, 21.0), stage(1, 16.0)]},
            "seq1f1b/2": {"k": 4, "stages": [stage(0, 13.0, [256] * 4), stage(1, 12.0, [256] * 4)]}}
    recorded = tmp_path / "measured.json"
    recorded.write_text(json.dumps({"header": "HEADER\n\n", "end": "done in 1 s", "runs": {"2": runs}}))
    argv = ["--pp", "2", "--seq-length", "1024", "--num-layers", "2", "--replay", str(recorded)]
    results, text = cp_memory.main([*argv, "--record", str(tmp_path / "again.json")])
    assert capsys.readouterr().out.startswith("HEADER\n\n") and text.endswith(f"done in 1 s (measurements replayed "
                                                                              f"from {recorded})")
    # the simulator's columns are this code's, for the recorded runs' shapes
    shape = (_config(2), 1024, 2, 2, 4, 4, [256] * 4)
    assert results[2][("seq1f1b", 2)]["predicted"] == cp_memory.predicted(*shape)
    assert results[2][("1f1b", 1)]["kept"] == cp_memory.predicted(_config(1), 1024, 1, 2, 4, in_flight=False)
    assert results[2][("1f1b", 2)]["peak"] == 21.0 * MB
    assert json.loads((tmp_path / "again.json").read_text())["runs"] == {"2": runs}  # --record writes them back
