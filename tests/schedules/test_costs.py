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
