""""auto" with "auto_recompute": the recompute setting (none, selective, full uniform 1) chosen with the schedule,
the fastest that fits the budget, against each candidate simulated on its own (schedules/recompute.evaluate)."""
from types import SimpleNamespace

import pytest

from megatron_ds.schedules import auto
from megatron_ds.schedules.auto_recompute import KNOBS, Knobs, as_dict, core_share, of_dict, start
from megatron_ds.schedules.costs import ModelCosts
from megatron_ds.schedules.ir import ScheduleError
from megatron_ds.schedules.measurement import Measured, model_costs
from megatron_ds.schedules.recompute import Recompute, evaluate, layer_memory

PP, M, LAYERS, SEQ = 4, 8, 8, 256
# attention dropout on CPU: torch's unfused kernel keeps (s x s) probabilities, which selective recompute frees
CONFIG = SimpleNamespace(num_layers=LAYERS, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4,
                         attention_dropout=0.1, max_position_embeddings=SEQ)
KNOB = Knobs.of(CONFIG, SEQ, 1, 4, PP).on_device(False)
MEMORY = layer_memory(CONFIG, SEQ, 1, 4)


def peak(schedule, recompute):
    """The peak memory, in one 1F1B stage's activations with nothing recomputed, simulated directly."""
    return evaluate(schedule, ModelCosts(), recompute, MEMORY, LAYERS, 0.1).peak_memory_max


def start_table():
    return {(c, r): peak(s, r) for c, s in auto.candidates(PP, M, LAYERS) for r in KNOBS}


def test_core_share_is_the_attention_flops():
    h, f, s = 64, 256, SEQ
    core = 2 * h * s * s  # causal: 4 h sum t
    linear = (2 * h * 3 * h + 2 * h * h + 2 * 2 * h * f) * s
    assert core_share(CONFIG, SEQ) == pytest.approx(core / (core + linear), rel=1e-12)
    assert of_dict(as_dict(Recompute("full", "uniform", 1))) == Recompute("full", "uniform", 1)


def test_start_is_the_least_recompute_under_which_a_start_fits():
    table, first = start_table(), auto.starts(PP, M, LAYERS)
    none_min = min(table[c, KNOBS[0]] for c in first)
    sel_min = min(table[c, KNOBS[1]] for c in first)
    full_min = min(table[c, KNOBS[2]] for c in first)
    assert full_min < sel_min < none_min  # the unfused core: selective frees the (s x s) part
    for budget, want in [(none_min, KNOBS[0]), ((none_min + sel_min) / 2, KNOBS[1]),
                         ((sel_min + full_min) / 2, KNOBS[2])]:
        cand, recompute, _ = start(budget, PP, M, LAYERS, KNOB)
        assert recompute == want
        assert cand == next(c for c in first if table[c, want] <= budget + 1e-9)  # starts' order
    with pytest.raises(ScheduleError, match=rf"even recomputing every layer \(full uniform 1\); the smallest "
                                            rf"budget that fits is {full_min:g}"):
        start(full_min * 0.99, PP, M, LAYERS, KNOB)


def measured(b_extra=0.0):
    f = [1.0] * PP
    return Measured(f, [2.0 + b_extra] * PP, [1.0] * PP)


def test_decide_picks_the_fastest_setting_that_fits():
    costs = model_costs(measured(), PP)
    table = start_table()
    rows = {}  # every catalogue candidate under every setting, simulated on its own
    for c, s in auto.candidates(PP, M, LAYERS):
        for r in KNOBS:
            res = evaluate(s, costs, r, MEMORY, LAYERS, KNOB.core_share)
            rows[c, r] = (res.makespan, res.peak_memory_max)
    none_best = min(rows[c, KNOBS[0]][1] for c, _ in auto.candidates(PP, M, LAYERS))
    for budget in (100.0, none_best, none_best * 0.8, min(table.values()) * 1.01):
        decision = auto.decide(PP, M, LAYERS, budget, measured(), knobs=KNOB, running=KNOBS[0])
        choice = decision["choice"]
        chosen = of_dict(choice["recompute"])
        assert choice["memory"] <= budget + 1e-9
        fitting = [t for (c, r), (t, mem) in rows.items() if mem <= budget + 1e-9]
        assert choice["makespan"] <= min(fitting) + 1e-9  # searched and cost-built schedules may beat the catalogue
        if budget == 100.0:
            assert chosen == Recompute() and choice["recompute_label"] == "none"  # recomputing only costs time
        if budget < none_best:  # no catalogue schedule fits without recompute (a searched one may, slower)
            assert chosen != Recompute() or choice["label"].startswith("zb-search")
        options = choice["recompute_options"]
        assert options[chosen.label] == {"label": choice["label"], "makespan": choice["makespan"]}
        assert all(o is None or o["makespan"] >= choice["makespan"] for o in options.values())
        line = auto.describe(decision)
        assert f"; recompute {chosen.label}, the fastest that fits (the fastest under each: none: " in line
        runner = decision["runner_up"]
        assert runner is None or f"; runner-up {runner['label']} under recompute {runner['recompute_label']} (" in line


def test_costs_timed_under_recompute_are_taken_back():
    # timed under full recompute each B ran its layers' forward again: the same decision as timed without
    plain = auto.decide(PP, M, LAYERS, 3.0, measured(), knobs=KNOB, running=KNOBS[0])
    full = auto.decide(PP, M, LAYERS, 3.0, measured(b_extra=1.0), knobs=KNOB, running=KNOBS[2])
    assert full["choice"]["label"] == plain["choice"]["label"]
    assert full["choice"]["recompute"] == plain["choice"]["recompute"]
    assert full["choice"]["makespan"] == pytest.approx(plain["choice"]["makespan"], rel=1e-12)
    share = KNOB.core_share
    sel = auto.decide(PP, M, LAYERS, 3.0, measured(b_extra=share), knobs=KNOB, running=KNOBS[1])
    assert sel["choice"]["makespan"] == pytest.approx(plain["choice"]["makespan"], rel=1e-12)


def test_a_byte_budget_counts_in_its_own_unit():
    unit = auto.unit_bytes(LAYERS / PP, SEQ, 1, 64, 4, 4)
    knobs = Knobs.of(CONFIG, SEQ, 1, 4, PP, unit).on_device(False)
    schedule = auto.candidates(PP, M, LAYERS)[0][1]
    for r in KNOBS:
        bytes_ = peak(schedule, r) * MEMORY.kept * LAYERS / PP
        assert knobs.peak(schedule, r) == pytest.approx(bytes_ / unit, rel=1e-12)
