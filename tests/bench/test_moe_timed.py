"""bench.moe_timed at toy size (p=2, 4 layers, the first two MoE): every schedule's row holds the simulation
of the measured costs and the timed engines' figures; the timed all-to-all is slept only by the ranks that
hold MoE layers. Structure only - the timings of a loaded test machine prove nothing."""
import pytest

from bench import moe_timed

TOY = ["--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "1",
       "--pp", "2", "--micro-batches", "4", "--num-layers", "4", "--vocab-size", "256", "--moe-layer-freq", "1,1,0,0",
       "--repeats", "2", "--warmup", "1", "--iterations", "1", "--timed-warmup", "0", "--time-scale", "1"]


@pytest.mark.timeout(600)
def test_every_schedule_timed_and_simulated_with_the_all_to_all_apart(capsys):
    table = moe_timed.main(TOY)
    out = capsys.readouterr().out
    assert list(table) == list(moe_timed.SCHEDULES)
    for name, row in table.items():
        assert row["iteration"] > 0 and row["sim"] > 0 and 0 < row["sim_a2a"] < 1, name
        assert len(row["activations"]) == len(row["weights"]) == 2 and min(row["activations"]) > 0
        assert row["a2a"] == max(row["a2a_ranks"]) > 0
    # 1f1b: rank 1 holds layers 2 and 3, both dense: it sleeps no all-to-all; zbv puts layer 1 on rank 1
    assert table["1f1b"]["a2a_ranks"][1] == 0 and table["1f1b"]["a2a_ranks"][0] > 0
    assert min(table["zbv"]["a2a_ranks"]) > 0
    assert sum(table["bitpipe"]["weights"]) == pytest.approx(2 * sum(table["1f1b"]["weights"]))  # two replicas
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| schedule")]
    assert [line.split("|")[1].strip() for line in rows] == list(moe_timed.SCHEDULES)


def test_each_timed_layer_sleeps_its_own_costs():
    from megatron_ds.schedules.costs import ModelCosts
    costs = ModelCosts.of_layers([(2, 2, 1), (1, 1, 1)], 1, embed=(0.5, 0, 0), head=(1, 1, 1),
                                 all_to_all=((0.25, 0.125), (0, 0)))
    assert moe_timed.layer_seconds(costs, 2, 1) == [((2.5, 2, 1), (0.25, 0.125)), ((2, 2, 2), (0, 0))]
