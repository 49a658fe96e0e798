""""auto" and overlapped units, torch-free: the overlapped orders are candidates where the model has
an all-to-all; one is chosen only where its simulation beats every plain candidate that fits, given the host
time per piece; the log line says which way and why."""
import pytest

from megatron_ds.schedules import auto, build_schedule, measurement
from megatron_ds.schedules.costs import ModelCosts, evaluate

MS = 1e-3
PP, M, LAYERS = 4, 8, 8


def moe(piece_host=0.0, a2a=(0.15, 0.3)):
    """8 MoE layers, each F = B = W = 0.35 ms of compute and an all-to-all of 0.15 ms in F and 0.3 in B: per
    1F1B stage of two layers 0.9 of 3.0 ms, 30 % of the work."""
    return ModelCosts.of_layers([(0.35 * MS,) * 3] * LAYERS, PP, all_to_all=((a2a[0] * MS, a2a[1] * MS),) * LAYERS,
                                piece_host=piece_host * MS)


def fastest(costs, overlap, budget=100):
    """The fastest catalogued order that fits, simulated here one by one (overlapped: the ones that have one)."""
    best = float("inf")
    for cand, _ in auto.candidates(PP, M, LAYERS):
        try:
            schedule = build_schedule(cand.schedule, PP, M, overlap=overlap, **dict(cand.knobs))
        except Exception:
            continue
        res = evaluate(schedule, costs)
        if res.peak_memory_max <= budget:
            best = min(best, res.makespan)
    return best


def test_overlap_is_chosen_at_30_percent_when_the_host_time_is_small():
    costs = moe(piece_host=0.002)
    rows = auto.rank(PP, M, LAYERS, 100, costs, overlap=True)
    assert rows[0]["candidate"].label == "dualpipev overlap=True"
    assert rows[0]["makespan"] == pytest.approx(fastest(costs, True))
    assert fastest(costs, True) < 0.96 * fastest(costs, False)  # piece by piece, each F piece 0.05 ms of 0.35
    plain = next(r for r in rows if not r["overlap"])
    assert plain["candidate"].label == "zbv" and plain["makespan"] == pytest.approx(fastest(costs, False))
    verdict = auto.overlap_verdict(rows, costs, 100)
    assert verdict["overlap"] is True
    assert verdict["why"].startswith(f"dualpipev overlap=True {rows[0]['makespan'] * 1e3:.1f} ms against zbv "
                                     f"{plain['makespan'] * 1e3:.1f} ms: it hides ")
    assert "(0.002 ms of host time per piece)" in verdict["why"]


def test_no_all_to_all_no_overlap():
    costs = moe(a2a=(0.0, 0.0))
    rows = auto.rank(PP, M, LAYERS, 100, costs, overlap=True)
    assert not any(r["overlap"] for r in rows)
    assert auto.overlap_verdict(rows, costs, 100) == {
        "overlap": False, "why": "no all-to-all to hide (no expert parallelism), so no overlapped order was weighed"}
    # and the simulation agrees: without an all-to-all no overlapped order beats the plain ones
    assert fastest(costs, True) >= fastest(costs, False)


def test_a_host_time_that_outweighs_what_it_hides_is_a_no():
    costs = moe(piece_host=0.1)
    rows = auto.rank(PP, M, LAYERS, 100, costs, overlap=True)
    assert rows[0]["candidate"].label == "zbv" and not rows[0]["overlap"]
    verdict = auto.overlap_verdict(rows, costs, 100)
    assert verdict["overlap"] is False
    assert verdict["why"].startswith("the fastest overlapped order, dualpipev overlap=True, ")
    assert verdict["why"].endswith("; its pieces' host time outweighs what it hides")


@pytest.mark.parametrize("piece_host", [0.0, 0.01, 0.02, 0.03, 0.04, 0.05])
def test_yes_exactly_where_the_simulation_says_it_pays(piece_host):
    costs = moe(piece_host=piece_host)
    verdict = auto.overlap_verdict(auto.rank(PP, M, LAYERS, 100, costs, overlap=True), costs, 100)
    assert verdict["overlap"] == (fastest(costs, True) < fastest(costs, False))


def test_no_overlapped_order_fits_a_tight_budget():
    """At budget 4 only zbv-like orders fit (dualpipev and its overlapped order hold 4.5)."""
    costs = moe(piece_host=0.002)
    rows = auto.rank(PP, M, LAYERS, 4, costs, overlap=True)
    assert rows and not any(r["overlap"] for r in rows)
    assert auto.overlap_verdict(rows, costs, 4) == {"overlap": False,
                                                    "why": "no overlapped order fits the memory budget 4"}


def measured(piece_host):
    """What a timing window of a linear start would hold for `moe()`: per stage two MoE layers' compute, their
    all-to-all apart, and the host time per piece."""
    stage = [0.7 * MS] * PP
    return measurement.Measured(stage, stage, stage, layer_kinds=((1, 1),) * PP,
                                all_to_all=((0.3 * MS, 0.6 * MS),) * PP, piece_host=piece_host * MS)


def test_decide_and_its_log_line():
    yes = auto.decide(PP, M, LAYERS, 100, measured(0.002), overlap=True)
    assert yes["choice"]["section"] == {"schedule": "dualpipev", "overlap": True}
    assert yes["overlap"]["overlap"] is True
    assert "; overlap of the all-to-all: yes, dualpipev overlap=True " in auto.describe(yes)
    no = auto.decide(PP, M, LAYERS, 100, measured(0.1), overlap=True)
    assert no["choice"]["section"] == {"schedule": "zbv"} and no["overlap"]["overlap"] is False
    assert "; overlap of the all-to-all: no, the fastest overlapped order, " in auto.describe(no)
    # not asked (the engine's call until the runtime runs overlapped units): as before, no verdict in the line
    plain = auto.decide(PP, M, LAYERS, 100, measured(0.002))
    assert "overlap" not in plain and plain["choice"]["section"] == {"schedule": "zbv"}
    assert "overlap of the all-to-all" not in auto.describe(plain)
