"""compare_rows: every schedule simulated on one ModelCosts, with its vocabulary-parallel twin and its
balanced ideal."""
from megatron_ds.schedules import build_schedule
from megatron_ds.schedules.compare import compare_rows
from megatron_ds.schedules.costs import ModelCosts, evaluate

HEAD, EMBED = (3.0, 3.0, 3.0), (0.25, 0.5, 0.0)


def test_rows_carry_the_head_the_vocabulary_twin_and_the_ideal():
    rows = {(r["schedule"], r["setting"]): r for r in compare_rows(2, 4, head=HEAD, embed=EMBED, head_memory=2.0,
                                                                   vocab_parallel=True, seq_splits=(2,))}
    costs = ModelCosts(embed=EMBED, head=HEAD, head_memory=2.0)
    for name in ("1f1b", "zbv"):
        naive, vocab = rows[(name, "")], rows[(name, "+vocab")]
        res = evaluate(build_schedule(name, 2, 4), costs)
        assert (naive["makespan"], naive["peak_memory"]) == (res.makespan, res.peak_memory_max)
        assert vocab["makespan"] == evaluate(build_schedule(name, 2, 4, vocab_parallel=True), costs).makespan
        ideal = evaluate(build_schedule(name, 2, 4), costs.balanced(2)).makespan
        assert naive["ideal"] == vocab["ideal"] == ideal
        assert naive["makespan"] > 1.2 * vocab["makespan"] and vocab["makespan"] <= 1.05 * ideal


def test_seq_costs_weigh_the_segments():
    even, skewed = (next(r for r in compare_rows(4, 8, seq_splits=(2,), seq_costs=f) if r["setting"] == "k=2")
                    for f in (None, lambda k: [3.0, 1.0]))
    s = build_schedule("seq1f1b", 4, 8, seq_splits=2)
    assert skewed["makespan"] == evaluate(s, ModelCosts(), seq_costs=[3.0, 1.0]).makespan != even["makespan"]


def test_the_table_reads_lower_is_better_as_the_readme():
    """One direction for "better": the ratio column is time over 1F1B's, named so in its header."""
    from megatron_ds.schedules.compare import format_table
    lines = format_table(compare_rows(4, 8)).splitlines()
    assert lines[0].split()[-4:] == ["time/1f1b", "(lower", "is", "better)"]
    ratio = {line.split()[0]: float(line.split()[-1]) for line in lines[2:] if "n/a" not in line}
    assert ratio["1f1b"] == 1.0 and ratio["zbv"] == round(25.5 / 33, 3) < 1
