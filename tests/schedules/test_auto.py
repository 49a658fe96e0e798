"""schedules/auto.py: which schedules fit a memory budget, the start-up schedule, the refusal naming
the smallest budget that fits, the costs model from per-stage times, and the choice."""
from collections import Counter

import pytest

from megatron_ds.schedules import ScheduleError, auto, measurement
from megatron_ds.schedules.kinds import Kind


def test_memory_table_pp4():
    table = {c.label: mem for c, mem in auto.memory_table(4, 8, 8)}
    assert table == {"gpipe": 8.0, "1f1b": 4.0, "interleaved virtual_stages=2": 5.5, "zb-h1": 4.0, "zb-h2": 7.0,
                     "zbv": 4.0, "bitpipe": 4.0, "zbv-half": 3.0, "zbv-min": 2.0, "dualpipev": 4.5}


def test_candidates_follow_the_layer_count():
    # 4 layers at pp=4: no schedule of 8 virtual stages can be cut
    assert [c.label for c, _ in auto.candidates(4, 8, 4)] == ["gpipe", "1f1b", "zb-h1", "zb-h2"]


@pytest.mark.parametrize("budget,start", [(100, "zb-h1"), (4, "zb-h1"), (3.5, "zbv-half"), (2, "zbv-min")])
def test_start_schedule_is_the_first_split_one_that_fits(budget, start):
    assert auto.check_budget(budget, 4, 8, 8).label == start


def test_too_small_budget_names_the_smallest_that_fits():
    with pytest.raises(ScheduleError, match=r"memory_budget 3 .*fits no schedule at pp=8, 16 micro-batches; "
                                            r"the smallest budget that fits is 3.5 \(zbv-min needs 3.5"):
        auto.check_budget(3, 8, 16, 16)
    assert auto.check_budget(3.5, 8, 16, 16).label == "zbv-min"


def test_model_costs_from_stage_times():
    # pp=4 linear: interior stages 2 ms F; the last stage 3 ms (a 1 ms head), the first 2.5 ms (embedding)
    m = auto.Measured(f=[2.5, 2.0, 2.0, 3.0], b=[2.0] * 4, w=[1.0] * 4)
    costs = auto.model_costs(m, 4)
    assert (costs.tf, costs.tb, costs.tw) == (2.0, 2.0, 1.0)
    assert costs.embed == (0.5, 0.0, 0.0) and costs.head == (1.0, 0.0, 0.0)
    # the same model timed under a V (8 stages of half the layers each)
    v = auto.model_costs(auto.Measured(f=[1.5] + [1.0] * 6 + [2.0], b=[1.0] * 8, w=[0.5] * 8), 4)
    assert (v.tf, v.tb, v.tw, v.embed, v.head) == (2.0, 2.0, 1.0, (0.5, 0.0, 0.0), (1.0, 0.0, 0.0))


def test_choice_respects_the_budget_and_names_the_runner_up():
    m = auto.Measured(f=[1.0] * 8, b=[1.0] * 8, w=[1.0] * 8)
    big = auto.decide(8, 16, 16, 100, m)
    assert big["choice"]["label"] == "zbv" and big["choice"]["makespan"] == pytest.approx(51.5)
    assert big["runner_up"]["label"] == "dualpipev"  # ties on makespan go to the smaller memory
    small = auto.decide(8, 16, 16, 5, m)
    assert small["choice"]["label"] == "zbv-half" and small["choice"]["memory"] <= 5
    assert small["runner_up"]["label"] == "zbv-min"
    text = auto.describe(small)
    assert "auto schedule: zbv-half" in text and "runner-up zbv-min" in text


def test_heavy_head_moves_the_choice_off_the_v():
    # a head as heavy as 4 stages' F and B: V schedules put it on rank 0 with the first stage
    m = auto.Measured(f=[1.0, 1.0, 1.0, 5.0], b=[1.0, 1.0, 1.0, 5.0], w=[1.0] * 4)
    rows = auto.rank(4, 8, 8, 100, auto.model_costs(m, 4))
    assert rows[0]["candidate"].label != "zbv"
    assert rows == sorted(rows, key=lambda r: r["makespan"])


def test_bytes():
    assert auto.parse_bytes("24GiB") == 24 * 2 ** 30 and auto.parse_bytes("1.5 GB") == 1_500_000_000
    assert auto.parse_bytes("12") is None and auto.parse_bytes("GiB") is None
    # s=16, b=2, h=32, a=4, fp32: 16*2*32*(34 + 5*4*16/32) * 2 bytes per layer, 2 layers
    assert auto.unit_bytes(2, 16, 2, 32, 4, 4) == 16 * 2 * 32 * 44 * 2 * 2



def test_search_fills_the_memory_between_zb_h1_and_zb_h2():
    # p=4, m=8, TF:TB:TW = 1:1:0.5: ZB-H1 needs 4 units and takes 24.5, ZB-H2 7 units and 23.0
    costs = auto.model_costs(auto.Measured(f=[1.0] * 4, b=[1.0] * 4, w=[0.5] * 4), 4)
    found = {c.label: (s, args) for c, s, args in auto.searched(4, 8, 5, costs)}
    assert list(found) == ["zb-search cap=4", "zb-search cap=5"]
    for label, cap, makespan in (("zb-search cap=4", 4, 24.5), ("zb-search cap=5", 5, 23.0)):
        res = auto.evaluate(found[label][0], costs)
        assert res.peak_memory_max <= cap and res.makespan == pytest.approx(makespan)
    # within budget 5 only the search reaches ZB-H2's makespan on the linear placement
    rows = auto.rank(4, 8, 4, 5, costs, search=True)  # 4 layers: linear schedules only
    assert rows[0]["candidate"].label == "zb-search cap=5" and rows[0]["makespan"] == pytest.approx(23.0)
    assert auto.schedule_maker({"search": rows[0]["search"]})(4, 8).ranks == found["zb-search cap=5"][0].ranks
    assert rows[1]["candidate"].label in ("zb-h1", "zb-search cap=4")


def even_cuts(seq=16, hidden=64, ks=(2, 4)):
    from megatron_ds.schedules.seq_split import even_segment_lengths, segment_costs
    return tuple(auto.Cut(k, tuple(even_segment_lengths(seq, k)), tuple(segment_costs(even_segment_lengths(seq, k),
                                                                                     hidden))) for k in ks)


def test_seq1f1b_candidates_follow_the_cuts():
    table = {c.label: mem for c, mem in auto.memory_table(4, 8, 8, even_cuts())}
    # rank 0 holds p + k - 1 segments of 1/k: 5/2 and 7/4 micro-batches
    assert table["seq1f1b seq_splits=2"] == 2.5 and table["seq1f1b seq_splits=4"] == 1.75
    assert table["seq1f1b seq_splits=4 split_backward=True"] == 1.75
    assert not any(label.startswith("seq1f1b") for label in {c.label for c, _ in auto.memory_table(4, 8, 8)})
    # a budget only Seq1F1B fits: it starts there; linear starts come first, by memory
    assert auto.check_budget(1.8, 4, 8, 8, even_cuts()).label == "seq1f1b seq_splits=4 split_backward=True"
    assert auto.check_budget(3, 4, 8, 8, even_cuts()).label == "seq1f1b seq_splits=2 split_backward=True"


def test_probe_is_a_linear_schedule_of_another_op_size_that_fits():
    cuts = even_cuts()
    start = auto.check_budget(100, 4, 8, 8, cuts)
    assert auto.probe(start, 100, 4, 8, 8, cuts).label == "seq1f1b seq_splits=4 split_backward=True"
    two = auto.check_budget(3, 4, 8, 8, cuts)
    assert auto.probe(two, 3, 4, 8, 8, cuts).label == "seq1f1b seq_splits=4 split_backward=True"
    four = auto.check_budget(1.8, 4, 8, 8, cuts)
    assert auto.probe(four, 1.8, 4, 8, 8, cuts) is None  # 2 segments need 2.5
    assert auto.probe(auto.check_budget(100, 4, 8, 8), 100, 4, 8, 8) is None  # no cuts: nothing to probe with


def test_seq1f1b_under_a_small_budget_with_as_many_segments_as_its_fixed_op_time_pays_for():
    # p=4, m=8, 1:1:0.5 at budget 3: ZB-V-Half (3 units) against Seq1F1B (2.5 and 1.75 units)
    cuts = even_cuts()
    lean = auto.decide(4, 8, 8, 3, auto.Measured([1.0] * 4, [1.0] * 4, [0.5] * 4), cuts)
    assert lean["choice"]["label"] == "seq1f1b seq_splits=4 split_backward=True"
    assert lean["choice"]["makespan"] == pytest.approx(21.18, abs=0.01) and lean["choice"]["memory"] == 1.75
    assert lean["choice"]["section"] == {"schedule": "seq1f1b", "seq_splits": 4, "split_backward": True}
    # 0.1 of a stage's F per op: 4 segments' 96 ops per rank cost more than they save, 2 segments (48) do not
    costly = auto.Measured([1.0] * 4, [1.0] * 4, [0.5] * 4, op_overhead=(0.1, 0.1, 0.1))
    heavy = auto.decide(4, 8, 8, 3, costly, cuts)
    assert heavy["choice"]["label"] == "seq1f1b seq_splits=2 split_backward=True"
    assert heavy["choice"]["makespan"] >= 22.32 + 48 * 0.1  # every one of a rank's 48 ops pays it, or more
    assert ("fixed per op F/B/W=100.00/100.00/100.00 ms (micro-batches timed whole; 0.00 ms of it from the traced "
            "makespans)") in auto.describe(heavy)
    # without cuts (a sequence too short to split) the V is the best that fits, its order built for the
    # measured costs: (1 + 2 x 0.1, 1 + 0.2, 0.5 + 0.2) relative to their mean
    choice = auto.decide(4, 8, 8, 3, costly)["choice"]
    assert choice["section"] == {"schedule": "zbv-half", "op_costs": (1.161, 1.161, 0.677)}
    unit = next(r for r in auto.rank(4, 8, 8, 3, auto.model_costs(costly, 4)) if r["candidate"].label == "zbv-half")
    assert choice["makespan"] < unit["makespan"] - 0.4, (choice, unit)  # 31.10 vs 31.55


def test_vocabulary_parallel_candidates_carry_the_passes():
    plain = auto.candidates(4, 8, 8, even_cuts(16))
    vocab = auto.candidates(4, 8, 8, even_cuts(16), vocab_parallel=True)
    assert [c for c, _ in vocab] == [c for c, _ in plain]  # the same choices, each with the passes
    for (_, v), (_, s) in zip(vocab, plain):
        assert v.vocab_parallel and not s.vocab_parallel
        assert [Counter(op for op in ops if not op.kind.traits.vocab) for ops in v.ranks] == [Counter(o) for o in s.ranks]
        assert all({op.kind for op in ops} >= {Kind.EF, Kind.S, Kind.T, Kind.EW} for ops in v.ranks)


def test_vocabulary_passes_measured_set_the_head_and_embedding_costs():
    # per slice (p=4): EF 0.1, S 1.0, T 0.5, EW 0.2 ms on a micro-batch, fixed part F 0.01, B 0.02, W 0.03
    base = auto.Measured(f=[2.0] * 4, b=[2.0] * 4, w=[1.0] * 4, op_overhead=(0.01, 0.02, 0.03))
    m = measurement.with_vocab(base, {"EF": 0.1, "S": 1.0, "T": 0.5, "EW": 0.2}, 1)
    assert m.vocab == pytest.approx((0.09, 0.97, 0.47, 0.15))  # less F; F + B; W; B + W
    costs = auto.model_costs(m, 4)
    assert costs.embed == pytest.approx((0.36, 0.6, 0.0)) and costs.head == pytest.approx((3.88, 0.0, 1.88))
    assert (costs.tf, costs.tb, costs.tw) == (2.0, 2.0, 1.0)
    # simulated, each pass costs what was measured: 1/p of the whole-vocabulary costs plus its fixed part
    schedule = auto.candidates(4, 8, 8, vocab_parallel=True)[1][1]
    res = auto.evaluate(schedule, costs)
    op = next(op for op in schedule.ranks[2] if op.kind is Kind.S)
    assert res.end[op] - res.start[op] == pytest.approx(1.0)
    decision = auto.decide(4, 8, 8, 100, m, vocab_parallel=True, head_memory=2.0)
    assert decision["costs"]["vocab_parallel"] and decision["costs"]["head"] == pytest.approx([3.88, 0.0, 1.88])
    assert "with vocabulary parallelism" in auto.describe(decision) and "a micro-batch's logits 2 of it" in \
        auto.describe(decision)


def test_vocabulary_parallel_search_and_costed_orders_carry_the_passes():
    m = auto.Measured(f=[1.0] * 4, b=[1.5] * 4, w=[0.5] * 4, vocab=(0.1, 1.0, 0.5, 0.2))
    rows = auto.rank(4, 8, 8, 100, auto.model_costs(m, 4), search=True, vocab_parallel=True)
    searched = [r for r in rows if r["search"]]
    costed = [r for r in rows if r["candidate"].label.startswith("zbv-half op_costs=")]
    assert searched and costed
    for row in searched:
        schedule = auto.schedule_maker({"search": row["search"]})(4, 8)
        assert schedule.vocab_parallel and any(op.kind is Kind.T for op in schedule.ranks[0])
    # and what rank() simulated is that schedule, passes included
    for _, schedule, args in auto.searched(4, 8, 100, auto.model_costs(m, 4), vocab_parallel=True):
        assert schedule.vocab_parallel and schedule.ranks == auto.zb_search(4, 8, **args).ranks
    assert auto.build_schedule("zbv-half", 4, 8, vocab_parallel=True, **dict(costed[0]["candidate"].knobs)).vocab_parallel


def test_logits_in_the_budget():
    # 16 tokens x 2 x 64-token vocabulary x 4 bytes = 8192 bytes
    assert auto.logits_units(16, 2, 64, 8192) == 1.0
    plain = dict(auto.memory_table(4, 8, 8))
    held = dict(auto.memory_table(4, 8, 8, head_memory=1.0))
    sliced = dict(auto.memory_table(4, 8, 8, vocab_parallel=True, head_memory=1.0))
    for c in plain:  # the loss stage holds a micro-batch's logits at least, at most one per micro-batch
        assert plain[c] <= held[c] <= plain[c] + 8
    assert sum(held[c] > plain[c] for c in plain) >= 8
    # a quarter per S until its T: less than whole logits, though the passes' order may hold more micro-batches
    assert sum(sliced[c] < held[c] for c in plain) >= 6
