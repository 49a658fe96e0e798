import dataclasses

import pytest

from megatron_ds.schedules import build_schedule, simulate
from megatron_ds.schedules.costs import ModelCosts, evaluate


def test_per_stage_lists():
    costs = ModelCosts(1, 1, 1, embed=(0.5, 0.25, 0), head=(2, 2, 1))
    tf, tb, tw = costs.per_stage(build_schedule("zbv", 4, 8))
    assert tf == [1.0] + [0.5] * 6 + [2.5]
    assert tb == [0.75] + [0.5] * 6 + [2.5]
    assert tw == [0.5] * 7 + [1.5]
    assert costs.per_stage(build_schedule("1f1b", 2, 4))[0] == [1.5, 3.0]


def test_uniform_costs_are_the_plain_simulation():
    for name in ("1f1b", "zbv", "dualpipev", "interleaved"):
        s = build_schedule(name, 4, 8, **({"virtual_stages": 2} if name == "interleaved" else {}))
        assert evaluate(s, ModelCosts(1, 1, 0.5)).makespan == simulate(s, 1, 1, 0.5).makespan


def test_a_heavy_head_loads_the_rank_that_holds_it():
    # 1F1B: the head is on the last rank; every V schedule puts it on rank 0 with the embedding.
    costs = ModelCosts(1, 1, 1, embed=(0.25, 0.25, 0), head=(1, 1, 1))
    one = evaluate(build_schedule("1f1b", 4, 8), costs)
    v = evaluate(build_schedule("zbv", 4, 8), costs)
    assert one.busy == [8 * 3.5, 24, 24, 8 * 6]
    assert v.busy == [8 * 6.5, 24, 24, 24]
    # The loaded rank sets the pace: 1F1B's makespan grows by at least the head's m*(F+B+W).
    assert one.makespan >= simulate(build_schedule("1f1b", 4, 8)).makespan + 8 * 3 - 1e-9
    assert one.makespan == 57.5
    # ZB-V's rank 0 carries embedding, head and two chunks: it never idles and sets the makespan.
    assert v.makespan == v.busy[0] == 52.0


def test_cli_show_takes_head_and_embedding_costs(capsys):
    from megatron_ds.schedules.cli import main
    assert main(["show", "--schedule", "zbv", "--pp", "4", "--micro-batches", "8",
                 "--head-cost", "1,1,1", "--embed-cost", "0.25,0.25,0"]) == 0
    assert "makespan 52.000" in capsys.readouterr().out


def test_balanced_spreads_the_embedding_and_head_over_the_ranks():
    costs = ModelCosts(1, 1, 1, embed=(0.5, 0.25, 0), head=(2, 2, 1), head_memory=3.0)
    even = costs.balanced(4)
    assert (even.tf, even.tb, even.tw, even.embed, even.head, even.head_memory) == (
        1 + 2.5 / 4, 1 + 2.25 / 4, 1 + 1 / 4, (0, 0, 0), (0, 0, 0), 0.0)
    naive, ideal = (evaluate(build_schedule("1f1b", 4, 8), c) for c in (costs, even))
    assert sum(ideal.busy) == sum(naive.busy) and len(set(ideal.busy)) == 1
    assert ideal.makespan < naive.makespan


# A MoE model of 4 layers at p=2: layer 2 (0-based) has experts, costs twice a dense layer's compute and
# waits 0.5 in its forward's all-to-all, 0.25 in its backward's.
MOE = ModelCosts.of_layers([(1, 1, 1), (1, 1, 1), (2, 2, 2), (1, 1, 1)], 2,
                           all_to_all=((0, 0), (0, 0), (0.5, 0.25), (0, 0)), layer_memory=(1, 1, 3, 1))


def test_layers_of_their_own_cost_the_stages_that_hold_them():
    assert (MOE.tf, MOE.tb, MOE.tw) == (2.5, 2.5, 2.5)  # the mean 1F1B stage
    one, zbv = build_schedule("1f1b", 2, 1), build_schedule("zbv", 2, 4)
    assert MOE.per_stage(one) == ([2.0, 3.0], [2.0, 3.0], [2.0, 3.0])
    assert MOE.all_to_all_per_stage(one) == ([0, 0.5], [0, 0.25])
    assert MOE.per_stage(zbv)[0] == [1.0, 1.0, 2.0, 1.0]  # one layer per V stage; stage 2 on rank 1
    assert MOE.all_to_all_per_stage(zbv) == ([0, 0, 0.5, 0], [0, 0, 0.25, 0])
    assert MOE.op_times(one) == ([2.0, 3.5], [2.0, 3.25], [2.0, 3.0])
    assert MOE.stage_memory(one) == [2 * 2 / 6, 2 * 4 / 6]  # stage 1 holds 4 of the 6 units
    from megatron_ds.schedules.costs import stage_layers  # DeepSpeed's partition_uniform: the first stages longer
    assert [list(r) for r in stage_layers(6, 4)] == [[0, 1], [2, 3], [4], [5]]


def test_the_all_to_all_is_on_the_critical_path_of_a_moe_layers_f_and_b():
    """1F1B, p=2, one micro-batch, fused backward: F0 [0, 2], F1 [2, 5.5] (3 compute + 0.5 all-to-all),
    BW1 [5.5, 11.75] (B 3 + W 3 + 0.25), BW0 [11.75, 15.75]. The all-to-all is counted apart, on rank 1."""
    res = evaluate(build_schedule("1f1b", 2, 1), MOE)
    assert res.makespan == 15.75 and res.all_to_all == [0.0, 0.75] and res.busy == [6.0, 9.75]
    bare = evaluate(build_schedule("1f1b", 2, 1), dataclasses.replace(MOE, all_to_all=()))
    assert res.makespan - bare.makespan == 0.75 and bare.all_to_all == [0.0, 0.0]
    split = evaluate(build_schedule("zb-h1", 2, 1), MOE)  # B pays the backward's all-to-all, W none
    assert split.all_to_all == [0.0, 0.75]
    # memory: stage 1's micro-batch holds 4/3 units: F(1) allocates it on rank 1
    assert res.peak_memory == [pytest.approx(2 / 3), pytest.approx(4 / 3)]
    # the same model as plain per-stage lists: simulate's all_to_all and stage_memory
    plain = simulate(build_schedule("1f1b", 2, 1), [2, 3], [2, 3], [2, 3], all_to_all=([0, 0.5], [0, 0.25]),
                     stage_memory=[2 / 3, 4 / 3])
    assert (plain.makespan, plain.all_to_all, plain.peak_memory) == (res.makespan, res.all_to_all, res.peak_memory)


def test_compare_rows_report_the_all_to_all():
    from megatron_ds.schedules.compare import compare_rows
    rows = {r["schedule"]: r for r in compare_rows(2, 4, MOE.tf, MOE.tb, MOE.tw, layers=MOE.layers,
                                                  all_to_all=MOE.all_to_all, layer_memory=MOE.layer_memory)
            if not r["setting"]}
    for name in ("1f1b", "zbv"):
        res = evaluate(build_schedule(name, 2, 4), MOE)
        assert rows[name]["makespan"] == res.makespan and rows[name]["all_to_all"] == max(res.all_to_all) == 3.0
        assert rows[name]["memory"] == res.peak_memory
    assert rows["zbv"]["makespan"] < rows["1f1b"]["makespan"]
