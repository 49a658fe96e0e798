"""bench/layer_costs.py at toy size: positive measured costs, a table row for every catalogue schedule
variant (and its vocabulary-parallel twin), each the simulation of the measured costs with the
embedding and the head + loss in it. Timings on a loaded test machine prove nothing, so the vocabulary
test compares sizes far apart (a head of about 0.2 layers against about 40)."""
import pytest

from bench import layer_costs
from megatron_ds.schedules import CATALOG

TINY = ["--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32", "--pp", "2",
        "--micro-batches", "4", "--repeats", "2", "--warmup", "1", "--device", "cpu"]


def cells(line):
    """The cells of one markdown table row."""
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


@pytest.mark.parametrize("family", [[], ["--swiglu", "--normalization", "rmsnorm", "--position-embedding-type",
                                         "rope", "--num-key-value-heads", "2", "--disable-bias-linear"]])
def test_layer_costs_measures_and_simulates_every_catalogue_schedule(family, capsys):
    costs, rows = layer_costs.main(TINY + family)
    assert costs.tf > 0 and costs.tb > 0 and costs.tw > 0 and sum(costs.head) > 0 and sum(costs.embed) > 0
    assert costs.head_memory > 0
    out = capsys.readouterr().out
    table = [cells(line) for line in out[out.index("| schedule |"):].split("\n\n")[0].splitlines()[2:]]
    labels = [row[0] for row in table]
    assert {label.split()[0] for label in labels} == set(CATALOG)
    assert {"zbv-half costed", "zbv-min costed"} <= set(labels)  # the V orders built for the measured times
    assert {f"{name} +vocab" for name in ("1f1b", "zb-h1", "zbv", "gpipe", "dualpipev")} <= set(labels)
    assert '"schedule": "zbv-half", "op_costs": [' in out
    assert sorted(labels) == sorted(layer_costs.label(r) for r in rows)
    timed = [r for r in rows if "error" not in r]
    assert len(timed) == len(rows)
    assert all(r["makespan"] > 0 and 0 <= r["bubble"] < 1 and r["ideal"] > 0 for r in timed)
    assert [float(row[4]) for row in table if row[0] == "1f1b"] == [1.0]  # / 1F1B
    assert [row[1] for row in table] == sorted((row[1] for row in table), key=float)  # iteration ms, fastest first


def test_bad_model_flags_exit_2():
    with pytest.raises(SystemExit) as exc:
        layer_costs.main(TINY + ["--num-key-value-heads", "3"])
    assert exc.value.code == 2


def test_costs_out_feeds_the_costs_partition(tmp_path, capsys):
    """--costs-out writes one cost per pipeline layer; "costs:FILE" reads it and cuts by it."""
    import json

    from megatron_ds.pipe.plan.partition import cost_bounds
    from megatron_ds.schedules import placement

    path = tmp_path / "costs.json"
    layer_costs.main(TINY + ["--num-layers", "4", "--vocab-size", "4096", "--costs-out", str(path)])
    data = json.loads(path.read_text())
    assert len(data["layer_costs"]) == 4 + 3 and all(c > 0 for c in data["layer_costs"])
    assert data["layers"][0] == "embedding" and data["layers"][-1] == "head + loss"
    bounds = cost_bounds(f"costs:{path}", type("C", (), {"num_layers": 4})(), placement.v_shape(2))
    assert bounds[0] == 0 and bounds[-1] == 7 and len(bounds) == 5


def test_time_segments_prints_each_segment_beside_its_flop_share(capsys):
    from megatron_ds.schedules.seq_split import balanced_segment_lengths
    layer_costs.main(TINY + ["--time-segments", "--seq-splits", "2", "4"])
    out = capsys.readouterr().out
    for k in (2, 4):
        block = out[out.index(f"Seq1F1B k={k}: the segments together take "):].split("\n\n")[0].splitlines()
        assert float(block[0].split("take ")[1].split()[0]) > 0
        rows = [cells(line) for line in block[3:]]  # under the header and its rule
        assert [int(r[0]) for r in rows] == balanced_segment_lengths(32, k, 32)
        assert all(float(v) > 0 for r in rows for v in r[1:])
        assert abs(sum(float(r[-1]) for r in rows) - 1.0) < 0.01  # FLOP shares of the whole layer


def test_the_vocabulary_enters_every_row():
    """The measured embedding and head + loss are in every simulated row: a 512x larger vocabulary
    makes the naive rows slower against their balanced ideal, and the vocabulary-parallel rows
    faster than the naive ones and closer to that ideal (1F1B, ZB-H1, ZB-V)."""
    from megatron_ds.schedules import build_schedule
    from megatron_ds.schedules.costs import ModelCosts, evaluate

    flags = TINY + ["--num-layers", "4", "--repeats", "5", "--warmup", "2", "--seq-splits", "2"]
    (small, small_rows), (large, large_rows) = (layer_costs.main(flags + ["--vocab-size", str(v)]) for v in (64, 32768))
    layer = lambda c: c.tf + c.tb + c.tw  # noqa: E731  (one 1F1B stage: two layers)
    assert sum(small.head) < layer(small) and sum(large.head) > 2 * layer(large)
    assert small.head_memory < 1 < large.head_memory / 4
    for costs, rows in ((small, small_rows), (large, large_rows)):
        by = {layer_costs.label(r): r for r in rows}
        for name, knobs in (("1f1b", {}), ("zbv", {}), ("interleaved", {"virtual_stages": 2})):
            res = evaluate(build_schedule(name, 2, 4, **knobs), costs)
            row = by[f"{name} v=2" if knobs else name]
            assert (row["makespan"], row["peak_memory"]) == (res.makespan, res.peak_memory_max)
            bare = evaluate(build_schedule(name, 2, 4, **knobs), ModelCosts(costs.tf, costs.tb, costs.tw))
            assert row["makespan"] > bare.makespan and row["peak_memory"] >= bare.peak_memory_max
            vocab = evaluate(build_schedule(name, 2, 4, vocab_parallel=True, **knobs), costs)
            assert by[f"{name} v=2 +vocab" if knobs else f"{name} +vocab"]["makespan"] == vocab.makespan
    small_by = {layer_costs.label(r): r for r in small_rows}
    large_by = {layer_costs.label(r): r for r in large_rows}
    naive = [label for label in large_by if not label.endswith("+vocab")]
    for label in naive:
        if label.split()[0] == "bitpipe":  # its twin pipelines put a head on every rank at p=2 already
            continue
        off = lambda r: r["makespan"] / r["ideal"]  # noqa: E731
        # quiet: +0.14 (zbv-half, zbv-min: the V puts the head beside the embedding) to +0.55; a loaded machine
        # inflates the measured layer more than the head (+0.09 for zbv-half once under a busy test run)
        assert off(large_by[label]) > off(small_by[label]) + 0.05, label
        if f"{label} +vocab" in large_by:
            assert large_by[f"{label} +vocab"]["makespan"] < large_by[label]["makespan"], label
    for label in ("1f1b", "zb-h1", "zbv"):
        assert abs(off(large_by[f"{label} +vocab"]) - 1) < abs(off(large_by[label]) - 1), label
    assert large_by["1f1b"]["peak_memory"] > large.head_memory > small_by["1f1b"]["peak_memory"]


MOE = ["--num-layers", "4", "--num-experts", "4", "--moe-router-topk", "2", "--moe-layer-freq", "2",
       "--expert-model-parallel-size", "2", "--vocab-size", "256"]


def test_moe_layers_cost_their_own_and_the_all_to_all_is_timed_apart(tmp_path, capsys):
    """Every second layer MoE (4 experts, top-2, EP 2): the MoE layers and the dense ones each cost their
    own timed layer's F, B, W; the all-to-all (timed over gloo on 2 processes) is the MoE layers' own
    quantity, in the simulation and in the costs file, which marks them."""
    import json

    from megatron_ds.schedules import build_schedule
    from megatron_ds.schedules.costs import evaluate

    path = tmp_path / "costs.json"
    costs, rows = layer_costs.main(TINY + MOE + ["--costs-out", str(path)])
    out = capsys.readouterr().out
    assert costs.layers[0] == costs.layers[2] and costs.layers[1] == costs.layers[3] != costs.layers[0]
    assert costs.all_to_all[1] == costs.all_to_all[3] == (0.0, 0.0) and min(costs.all_to_all[0]) > 0
    assert costs.all_to_all[0] == costs.all_to_all[2] and costs.layer_memory[0] != costs.layer_memory[1]
    assert (costs.tf, costs.tb, costs.tw) == pytest.approx([sum(t[i] for t in costs.layers) / 2 for i in range(3)])
    data = json.loads(path.read_text())
    assert data["layers"][1:5] == ["transformer 1 (MoE)", "transformer 2", "transformer 3 (MoE)", "transformer 4"]
    assert data["moe_layers"] == [1, 0, 1, 0]
    assert data["all_to_all_ms"] == [pytest.approx(sum(costs.all_to_all[0]) * 1e3, abs=1e-6), 0.0] * 2
    cost = data["layer_costs"][1:5]  # a MoE layer's F + B + W and its all-to-all
    assert cost[0] == cost[2] == pytest.approx(sum(costs.layers[0]) * 1e3 + data["all_to_all_ms"][0], abs=1e-5)
    assert cost[1] == cost[3] == pytest.approx(sum(costs.layers[1]) * 1e3, abs=1e-5)
    assert "MoE layer (2 of 4: 4 experts, top-2, expert FFN 128; router and experts at 64 routed rows)" in out
    assert "all-to-all per MoE layer, EP 2 over gloo: F " in out
    header = next(cells(line) for line in out.splitlines() if line.startswith("| schedule |"))
    assert header[-1] == "a2a"
    by = {layer_costs.label(r): r for r in rows}
    for name in ("1f1b", "zbv", "dualpipev"):  # every row is the simulation of these costs
        res = evaluate(build_schedule(name, 2, 4), costs)
        assert by[name]["makespan"] == res.makespan and by[name]["all_to_all"] == max(res.all_to_all) > 0
        row = next(cells(line) for line in out.splitlines() if line.startswith(f"| {name} |"))
        assert row[-1] == f"{max(res.all_to_all) / res.makespan:.1%}"


@pytest.mark.parametrize("flags", [["--moe-router-topk", "2"],
                                   ["--num-experts", "4", "--expert-model-parallel-size", "3"]])
def test_bad_moe_flags_exit_2(flags):
    with pytest.raises(SystemExit) as exc:
        layer_costs.main(TINY + flags)
    assert exc.value.code == 2
