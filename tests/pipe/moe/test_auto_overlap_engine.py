"""`"schedule": "auto"` and overlapped units on ScheduleEngine, PP=2 x DP=2.

A MoE GPT with expert parallelism 2 (tests/pipe/moe/test_moe_engine.py's softmax model) under the test-only latency
knob (model/moe_dispatch.py: every all-to-all LATENCY_MS more, a large share of the step): "auto" weighs the
overlapped orders, its pieces' host time measured (pipe/auto.piece_host), chooses one (the decision's verdict
says yes and why, its section carries "overlap": true, the engine then runs a schedule with units), and the run
trains equal to the chosen schedule run by hand from the first step (losses, eval loss and weights after
STEPS steps, fp32 1e-5), both equal to the single-process reference. The same model without expert parallelism
and no latency has no all-to-all: "auto" does not choose an overlapped order and its verdict says why. Forced
to the overlapped dualpipev (another placement), "auto" rebuilds through a checkpoint and trains equal to that
section run by hand.
piece_host itself: a small positive number of seconds, the runtime's switching between a unit's sides."""
import math
import os

import pytest

from megatron_ds.testing.launcher import run_ranks
from tests.gpt_harness import reference_run, tiny_config
from tests.pipe.moe.test_moe_engine import LR, MODELS, assert_expert_parallel_matches, with_expert_parallel

PP, DP, GAS, LAYERS, STEPS = 2, 2, 4, 4, 4
BUDGET = 8  # every candidate fits at pp=2, m=4, the overlapped 1f1b (4 units on rank 0) too
# ms per all-to-all: a MoE layer runs 3 in its forward and 2 in its backward, 2 MoE layers per stage, so a rank
# sleeps 40 x 6 = 240 ms a step, about a third of it ("auto" chose 1f1b overlap=True, 670 ms simulated against
# zb-h2's 748). At 3 ms (a quarter) the units, simulated piece by piece, tied with zb-h2 within the noise.
LATENCY_MS = 6.0
CASES = [("ep2", 2, LATENCY_MS), ("no_ep", 1, 0.0)]  # (name, expert parallelism, latency knob)


def assert_trained_alike(run, hand, what=""):
    """The "auto" run equals the chosen section run by hand: losses, eval loss and every weight it holds after
    STEPS steps within fp32's 1e-5."""
    assert max(abs(a - b) for a, b in zip(run["losses"], hand["losses"])) <= 1e-5, (run["losses"], hand["losses"])
    assert abs(run["eval_loss"] - hand["eval_loss"]) <= 1e-5
    assert run["weights"] and set(run["weights"]) <= set(hand["weights"])
    for key, w in run["weights"].items():
        diff = (w - hand["weights"][key]).abs().max().item()
        assert diff <= 1e-5, f"{what}weight {key} after {STEPS} steps, auto against by hand: {diff:.3g}"


def auto_then_by_hand(cases):
    """Per case: the "auto" run (its decision, whether the engine ended on units, losses, weights, eval loss) and,
    with expert parallelism, the chosen section's run by hand (tests/gpt_harness.engine_rank_run)."""
    import deepspeed
    from megatron_ds.model.moe_dispatch import TEST_LATENCY_ENV
    from megatron_ds.training.auto_schedule import switch_engine
    from tests.gpt_harness import (EVAL_STEP, auto_engine_builder, ds_config, engine_rank_run, layer_key,
                                   micro_batch, whole_tensors)
    deepspeed.init_distributed(dist_backend="gloo")
    out = []
    for _, ep, latency in cases:
        os.environ[TEST_LATENCY_ENV] = str(latency)
        model = with_expert_parallel("softmax", ep)
        config = tiny_config(LAYERS, **model)

        build = auto_engine_builder(config, PP, DP, LR)

        pipeline = {"schedule": "auto", "memory_budget": BUDGET, "timers_start_iter": 0, "timers_end_iter": 2}
        engine = build(ds_config(PP, DP, GAS, pipeline=pipeline, lr=LR))
        reports, losses = [], []
        engine.on_auto_decision = reports.append
        dp_rank = engine.grid.get_data_parallel_rank()
        for step in range(STEPS):
            batches = iter([micro_batch(step, dp_rank * GAS + j) for j in range(GAS)])
            losses.append(float(engine.train_batch(batches)))
            if len(reports) == 1 and reports[0].rebuild and step == 1:
                engine = switch_engine(engine, reports[0].decision, build)
        weights = {layer_key(engine.module, n): p.detach().float().clone() for n, p in engine.module.named_parameters()}
        weights = whole_tensors(engine, config, weights)
        eval_loss = float(engine.eval_batch(iter([micro_batch(EVAL_STEP, dp_rank * GAS + j) for j in range(GAS)])))
        decision = reports[0].decision
        run = dict(decision=decision, units=bool(engine.plan.schedule.overlap), losses=losses, weights=weights,
                   eval_loss=eval_loss, reports=len(reports))
        hand = None
        if ep > 1:  # the chosen schedule from the first step, as a user would ask for it
            hand = engine_rank_run(PP, GAS, STEPS, decision["choice"]["section"], num_layers=LAYERS, lr=LR, model=model)
        out.append((run, hand))
    os.environ.pop(TEST_LATENCY_ENV, None)
    return out


def test_auto_chooses_overlap_where_the_all_to_all_is_large_and_trains_as_by_hand():
    per_rank = run_ranks(PP * DP, auto_then_by_hand, CASES, timeout=1200)
    for i, (name, ep, _) in enumerate(CASES):
        runs = [r[i][0] for r in per_rank]
        decision = runs[0]["decision"]
        assert all(r["decision"] == decision and r["reports"] == 1 for r in runs)  # rank 0's, broadcast once
        verdict, section = decision["overlap"], decision["choice"]["section"]
        if ep == 1:  # no all-to-all: nothing to hide, no overlapped order weighed
            assert not verdict["overlap"] and "no all-to-all" in verdict["why"], verdict
            assert "overlap" not in section and not any(r["units"] for r in runs), section
            continue
        comm = decision["costs"]["all_to_all"]
        assert comm and min(max(t) for t in comm) > 0  # every layer is a MoE layer here, each with its all-to-all
        assert verdict["overlap"] and verdict["why"].startswith(decision["choice"]["label"]), verdict
        assert section.get("overlap") is True and all(r["units"] for r in runs), section
        hands = [r[i][1] for r in per_rank]
        for run, hand in zip(runs, hands):
            assert_trained_alike(run, hand, f"{name}: ")
        ref = reference_run(tiny_config(LAYERS, **MODELS["softmax"]), DP, GAS, STEPS, lr=LR)  # one process: no EP
        assert_expert_parallel_matches(hands, ref, DP)


def test_piece_host_is_a_small_positive_time_and_leaves_no_unit_open():
    """The runtime's switching alone (pipe/moe/overlap.OverlapRunner): each side hands the baton over where a MoE layer
    issues its all-to-alls, the state swapped at each hand-over counted (here a counter the two sides share)."""
    from megatron_ds.model.moe_dispatch import InFlight
    from megatron_ds.pipe.auto import A2A_PER_MOE_LAYER, PIECE_REPEATS, piece_host
    from megatron_ds.pipe.moe.overlap import OverlapRunner
    swaps = []
    t = piece_host(OverlapRunner(lambda: None, lambda state: swaps.append(state)))
    assert math.isfinite(t) and 0 < t < 0.05, t  # thread switches, not a step
    # each unit: a hand-over per all-to-all and back, the backward side's end: the baton passed at least that often
    assert len(swaps) >= PIECE_REPEATS * sum(A2A_PER_MOE_LAYER) and InFlight.meanwhile is None


@pytest.mark.parametrize("ep, vocab, weighed", [(2, False, True), (1, False, False), (2, True, False)])
def test_a_resumed_decision_counts_the_overlapped_candidates_where_they_are_weighed(ep, vocab, weighed):
    """training/auto_schedule.run_key's "candidates": the overlapped orders join them with expert parallelism
    (so a decision made before they were weighed is timed again), never otherwise."""
    from megatron_ds.pipe import auto as pipe_auto
    moe = with_expert_parallel("softmax", ep)["moe"]
    labels = pipe_auto.candidate_labels(2, 4, 4, (), vocab, moe)
    overlapped = {label for label in labels if "overlap=True" in label}
    assert overlapped == ({"1f1b overlap=True", "dualpipev overlap=True", "interleaved overlap=True virtual_stages=2"}
                          if weighed else set()), overlapped
    assert set(labels) - overlapped == set(pipe_auto.candidate_labels(2, 4, 4, (), vocab, None))


FORCED = "dualpipev overlap=True"


def forced_dualpipev_overlap_then_by_hand():
    """"auto" under expert parallelism, its decision forced (as tests/pipe/test_auto_engine.forcing does) to the
    overlapped dualpipev: the engine rebuilds through a checkpoint onto dualpipev's V placement (the 1f1b swap of
    the test above is in place), then the run by hand with the chosen section from the first step."""
    import dataclasses

    import deepspeed
    from megatron_ds.pipe.auto import AutoSwitch
    from megatron_ds.schedules import auto
    from megatron_ds.training.auto_schedule import switch_engine
    from tests.gpt_harness import EVAL_STEP, auto_engine_builder, ds_config, engine_rank_run, layer_key, micro_batch, \
        whole_tensors
    deepspeed.init_distributed(dist_backend="gloo")
    model = with_expert_parallel("softmax", 2)
    config = tiny_config(LAYERS, **model)

    def choose(pp, m, layers, budget, measured, cuts, vocab_parallel=False, head_memory=0.0, overlap=False):
        decision = auto.decide(pp, m, layers, budget, measured, cuts, vocab_parallel=vocab_parallel,
                               head_memory=head_memory, overlap=overlap)
        costs = dataclasses.replace(auto.model_costs(measured, pp), head_memory=head_memory)
        rows = auto.rank(pp, m, layers, budget, costs, measured.p2p, cuts=cuts, vocab_parallel=vocab_parallel,
                         overlap=overlap)
        row = next(r for r in rows if r["candidate"].label == FORCED)  # weighed: EP 2 has an all-to-all
        decision["choice"] = {"label": FORCED, "section": row["candidate"].section(), "search": None,
                              "makespan": row["makespan"], "memory": row["memory"]}
        return decision

    build = auto_engine_builder(config, PP, DP, LR)

    AutoSwitch.choose = staticmethod(choose)
    try:
        pipeline = {"schedule": "auto", "memory_budget": BUDGET, "timers_start_iter": 0, "timers_end_iter": 2}
        engine = build(ds_config(PP, DP, GAS, pipeline=pipeline, lr=LR))
        start, reports, losses, switched_at = engine.plan.schedule.name, [], [], None
        engine.on_auto_decision = reports.append
        dp_rank = engine.grid.get_data_parallel_rank()
        for step in range(STEPS):
            losses.append(float(engine.train_batch(iter([micro_batch(step, dp_rank * GAS + j) for j in range(GAS)]))))
            if reports and reports[-1].rebuild and switched_at is None:
                engine = switch_engine(engine, reports[-1].decision, build)
                switched_at = step
    finally:
        AutoSwitch.choose = staticmethod(auto.decide)
    weights = {layer_key(engine.module, n): p.detach().float().clone() for n, p in engine.module.named_parameters()}
    weights = whole_tensors(engine, config, weights)
    eval_loss = float(engine.eval_batch(iter([micro_batch(EVAL_STEP, dp_rank * GAS + j) for j in range(GAS)])))
    section = reports[0].decision["choice"]["section"]
    now = engine.plan.schedule
    run = dict(section=section, start=start, now=(now.name, bool(now.overlap)), switched_at=switched_at,
               reports=len(reports), losses=losses, weights=weights, eval_loss=eval_loss)
    return run, engine_rank_run(PP, GAS, STEPS, section, num_layers=LAYERS, lr=LR, model=model)


def test_auto_forced_to_dualpipev_overlap_rebuilds_through_a_checkpoint_and_trains_as_by_hand():
    per_rank = run_ranks(PP * DP, forced_dualpipev_overlap_then_by_hand, timeout=1200)
    for run, hand in per_rank:
        assert run["section"] == {"schedule": "dualpipev", "overlap": True}, run["section"]
        assert run["reports"] == 1 and run["switched_at"] is not None, run  # rebuilt once, through the checkpoint
        assert run["start"] != "dualpipev" and run["now"] == ("dualpipev", True), (run["start"], run["now"])
        assert_trained_alike(run, hand)
