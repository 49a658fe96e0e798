"""bench/layer_costs.py at toy size: positive measured costs and a table row for every catalogue
schedule variant. Structure only - timings on a loaded test machine prove nothing."""
import pytest

from bench import layer_costs
from megatron_ds.schedules import CATALOG

TINY = ["--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32", "--pp", "2",
        "--micro-batches", "4", "--repeats", "2", "--warmup", "1", "--device", "cpu"]


@pytest.mark.parametrize("family", [[], ["--swiglu", "--normalization", "rmsnorm", "--position-embedding-type",
                                         "rope", "--num-key-value-heads", "2", "--disable-bias-linear"]])
def test_layer_costs_measures_and_simulates_every_catalogue_schedule(family, capsys):
    tf, tb, tw, rows = layer_costs.main(TINY + family)
    assert tf > 0 and tb > 0 and tw > 0
    out = capsys.readouterr().out
    table = out[out.index("schedule "):].split("\n\n")[0].splitlines()[1:]
    labels = [line[:24].strip() for line in table]
    assert {label.split()[0] for label in labels} == set(CATALOG)
    assert {"zbv-half costed", "zbv-min costed"} <= set(labels)  # the V orders built for the measured times
    assert '"schedule": "zbv-half", "op_costs": [' in out
    assert sorted(labels) == sorted(r[0] for r in rows)
    timed = [r for r in rows if r[1] is not None]
    assert all(makespan > 0 and 0 <= bubble < 1 for _, makespan, bubble, _ in timed)
    assert [float(line.split()[-1]) for line in table if line[:24].strip() == "1f1b"] == [1.0]
    assert [line.split()[-4] for line in table[:len(timed)]] == sorted(
        (line.split()[-4] for line in table[:len(timed)]), key=float)  # fastest first


def test_bad_model_flags_exit_2():
    with pytest.raises(SystemExit) as exc:
        layer_costs.main(TINY + ["--num-key-value-heads", "3"])
    assert exc.value.code == 2


def test_costs_out_feeds_the_costs_partition(tmp_path, capsys):
    """--costs-out writes one cost per pipeline layer; "costs:FILE" reads it and cuts by it."""
    import json

    from megatron_ds.pipe.partition import cost_bounds
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
        rows = [line.split() for line in block[2:]]
        assert [int(r[0]) for r in rows] == balanced_segment_lengths(32, k, 32)
        assert all(float(v) > 0 for r in rows for v in r[1:])
        assert abs(sum(float(r[-1]) for r in rows) - 1.0) < 0.01  # FLOP shares of the whole layer
