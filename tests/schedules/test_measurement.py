"""schedules/measurement.py: an op's fixed time told from its per-token time, message latencies read off
traced iterations, and the calibration of the simulator against traced makespans."""
import pytest

from megatron_ds.schedules import auto, measurement
from tests.schedules.test_auto import even_cuts


def test_separate_tells_fixed_from_per_token_time():
    # per stage T = (4, 4, 6), B 2, W 1; fixed per op F 0.5, B 0.25, W 0: timed whole (k=1) and in 4 segments
    t = {"f": [4.0, 4.0, 6.0], "b": [2.0] * 3, "w": [1.0] * 3}
    fixed = (0.5, 0.25, 0.0)
    totals = {k: tuple([x + k * c for x in t[kind]] for kind, c in zip("fbw", fixed)) for k in (1, 4)}
    m = measurement.separate(totals, gap=0.125, p2p=0.01)
    assert m.f == pytest.approx(t["f"]) and m.b == pytest.approx(t["b"]) and m.w == pytest.approx(t["w"])
    assert m.op_overhead == pytest.approx((0.625, 0.375, 0.125)) and m.p2p == 0.01 and m.op_sizes == (1, 4)
    one = measurement.separate({2: totals[1]})  # one op size: the fixed time cannot be told apart
    assert one.op_overhead == (0.0, 0.0, 0.0) and one.f == totals[1][0]


def test_message_latencies_from_a_traced_iteration():
    from megatron_ds.schedules import Op, build_schedule
    s = build_schedule("1f1b", 2, 2)
    f = lambda st, mb: Op("F", 0, st, mb)  # noqa: E731
    bw = lambda st, mb: Op("BW", 0, st, mb)  # noqa: E731
    timed = {f(0, 0): (0.0, 1.0, None), f(0, 1): (1.0, 2.0, None),
             f(1, 0): (1.3, 2.3, 0.5),  # waited from 0.5, F(0, 0) ended at 1.0: 0.3
             bw(1, 0): (2.3, 4.3, None),  # its forward is local
             f(1, 1): (4.3, 5.3, 4.3),  # F(0, 1) ended at 2.0, before the wait began: says nothing
             bw(0, 0): (4.5, 6.5, 2.0),  # BW(1, 0) ended at 4.3: 0.2
             bw(1, 1): (5.3, 7.3, None), bw(0, 1): (7.4, 9.4, 7.0)}  # 0.1
    assert measurement.message_latencies(s, timed) == pytest.approx([0.3, 0.2, 0.1])


def test_calibrate_adds_what_the_simulator_misses_per_op():
    cuts = even_cuts()
    measured = auto.Measured([1.0] * 4, [1.0] * 4, [0.5] * 4, p2p=0.01, op_overhead=(0.02, 0.02, 0.01))
    start = dict(auto.candidates(4, 8, 8, cuts))[auto.Candidate("seq1f1b", (("seq_splits", 2), ("split_backward", True)))]
    probe = dict(auto.candidates(4, 8, 8, cuts))[auto.Candidate("seq1f1b", (("seq_splits", 4), ("split_backward", True)))]
    costs = auto.model_costs(measured, 4)
    shares = {c.k: c.costs for c in cuts}
    sim = [auto.evaluate(s, costs, p2p_latency=0.01, seq_costs=shares[s.seq_splits]).makespan for s in (start, probe)]
    assert (measurement.ops_per_rank(start), measurement.ops_per_rank(probe)) == (48, 96)
    # traced = simulated + 0.3 (the step, the same for all) + 0.005 per op of the busiest rank
    runs = [(s, t + 0.3 + 0.005 * measurement.ops_per_rank(s)) for s, t in zip((start, probe, start), sim + sim[:1])]
    fitted = measurement.calibrate(measured, 4, runs, cuts)
    assert fitted.op_residual == pytest.approx(0.005) and fitted.op_overhead == pytest.approx((0.025, 0.025, 0.015))
    assert measurement.calibrate(measured, 4, runs[:1], cuts) == measured  # one op count: nothing to fit
    faster = [(s, t - 0.001 * measurement.ops_per_rank(s)) for s, t in zip((start, probe), sim)]
    assert measurement.calibrate(measured, 4, faster, cuts).op_residual == 0  # never below 0


def test_two_stages_split_the_loss_stage_by_the_heads_flop_share():
    """pp=2, one stage per rank, 2 layers per stage of F, B, W = 1, 2, 0.5; the head + loss 3 layers'
    worth, the embedding (0.5, 0.2, 0): no interior stage shows a layer alone, so the head's FLOP share
    of the last stage tells the layers from the head, and the first stage's excess is the embedding."""
    layer, embed = (1.0, 2.0, 0.5), (0.5, 0.2, 0.0)
    f, b, w = ([2 * t + e, (2 + 3) * t] for t, e in zip(layer, embed))
    share = measurement.head_share(3.0, 4, 2)
    assert share == pytest.approx(3 / 5)
    costs = measurement.model_costs(auto.Measured(f, b, w, head_share=share), 2)
    assert (costs.tf, costs.tb, costs.tw) == pytest.approx((2.0, 4.0, 1.0))
    assert costs.embed == pytest.approx(embed) and costs.head == pytest.approx((3.0, 6.0, 1.5))
    s = auto.build_schedule("1f1b", 2, 4)
    assert auto.evaluate(s, costs).busy == pytest.approx([4 * (fi + bi + wi) for fi, bi, wi in zip(f, b, w)])
    blind = measurement.model_costs(auto.Measured(f, b, w), 2)  # the cheaper end taken as layers alone
    assert blind.embed == (0.0, 0.0, 0.0) and sum(blind.head) < sum(costs.head)


# A MoE model timed on a linear start at p=4, 8 layers: per stage the MoE flags of its layers (two mixes
# among the interior stages, so their times tell a dense layer from a MoE one). F, B, W of a dense layer,
# of a MoE layer (compute), the embedding, the head + loss; each MoE layer's all-to-all, timed apart.
MS = 1e-3
KINDS = ((1, 0), (0, 0), (1, 1), (0, 1))
DENSE, MOE, EMBED, HEAD, A2A = (1.0, 1.5, 0.5), (3.0, 4.0, 2.0), (0.2, 0.1, 0.0), (2.0, 3.0, 1.0), (0.4, 0.3)


def flat(pairs):
    return [x for t in pairs for x in t]


def moe_measured(kinds=KINDS, moe_flops=1.0):
    def stage(s, i):
        own = sum(MOE[i] if flag else DENSE[i] for flag in kinds[s])
        return (own + EMBED[i] * (s == 0) + HEAD[i] * (s == len(kinds) - 1)) * MS
    f, b, w = ([stage(s, i) for s in range(len(kinds))] for i in range(3))
    comm = tuple((sum(k) * A2A[0] * MS, sum(k) * A2A[1] * MS) for k in kinds)
    return measurement.Measured(f, b, w, layer_kinds=kinds, moe_flops=moe_flops, all_to_all=comm)


def test_moe_layers_told_from_dense_ones_and_the_all_to_all_kept_apart():
    costs = measurement.model_costs(moe_measured(), 4)
    flags = [f for k in KINDS for f in k]
    assert flat(costs.layers) == pytest.approx([x * MS for f in flags for x in (MOE if f else DENSE)])
    assert costs.embed == pytest.approx(tuple(x * MS for x in EMBED))
    assert costs.head == pytest.approx(tuple(x * MS for x in HEAD))
    assert flat(costs.all_to_all) == pytest.approx(flat((A2A[0] * MS, A2A[1] * MS) if f else (0, 0) for f in flags))
    assert costs.tf == pytest.approx((4 * 3.0 + 4 * 1.0) / 4 * MS)  # the mean 1F1B stage's compute
    # a ZB-V candidate cuts one layer per stage: its stage 2 (rank 2) holds layer 2, a dense one
    from megatron_ds.schedules import build_schedule
    zbv = build_schedule("zbv", 4, 8)
    assert costs.per_stage(zbv)[0][2] == pytest.approx(DENSE[0] * MS)
    assert costs.all_to_all_per_stage(zbv)[0][:3] == pytest.approx([A2A[0] * MS, 0.0, 0.0])


def test_moe_layers_in_the_same_mix_on_every_stage_are_told_apart_by_flops():
    """Every stage holds one MoE and one dense layer: the times cannot tell them apart, the FLOPs do (a MoE
    layer 3x a dense one here: each interior stage's F = 4 = 1 + 3)."""
    kinds = ((1, 0),) * 4
    costs = measurement.model_costs(moe_measured(kinds, moe_flops=3.0), 4)
    assert flat(costs.layers[:2]) == pytest.approx([3.0 * MS, 3.0 * 5.5 / 4 * MS, 3.0 * 2.5 / 4 * MS,
                                                    1.0 * MS, 5.5 / 4 * MS, 2.5 / 4 * MS])
    assert costs.embed[0] == pytest.approx(EMBED[0] * MS) and costs.head[0] == pytest.approx(HEAD[0] * MS)


def test_a_dense_model_keeps_the_stage_model():
    dense = measurement.Measured([1.2, 1.0, 1.0, 2.0], [1.0] * 4, [0.5] * 4)
    flagged = measurement.Measured([1.2, 1.0, 1.0, 2.0], [1.0] * 4, [0.5] * 4, layer_kinds=((0, 0),) * 4)
    assert measurement.model_costs(flagged, 4) == measurement.model_costs(dense, 4)
    assert measurement.model_costs(dense, 4).layers == () and measurement.model_costs(dense, 4).all_to_all == ()


def test_auto_decides_and_logs_with_the_moe_costs():
    decision = auto.decide(4, 8, 8, 8, moe_measured())
    k = decision["costs"]
    assert k["moe_layers"] == [1, 0, 0, 0, 1, 1, 0, 1]
    assert k["all_to_all"][0] == pytest.approx([A2A[0] * MS, A2A[1] * MS]) and k["all_to_all"][1] == [0.0, 0.0]
    assert k["layers"][0] == pytest.approx([x * MS for x in MOE])
    choice = decision["choice"]
    assert 0 < choice["all_to_all"] < choice["makespan"]
    line = auto.describe(decision)
    assert "a MoE layer F/B/W=3.00/4.00/2.00 ms (4 of 8 layers), a dense one 1.00/1.50/0.50 ms" in line
    assert f"all-to-all per MoE layer F/B=0.40/0.30 ms ({choice['all_to_all'] / choice['makespan']:.1%} " in line
