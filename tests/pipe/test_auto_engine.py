"""`"schedule": "auto"` on ScheduleEngine: it times two iterations, the first on its start-up schedule
(zb-h1), the second on its probe (the same placement, the micro-batch cut into 4 Seq1F1B segments),
decides, switches, and the run equals the single-process reference through the probe and the
switch: losses of 3 steps, every gradient of the first step, the weights after 3 optimizer steps and
the eval loss, fp32 1e-5. At PP=2 one launch runs eight cases: the engine's own choice; forced
choices that cover both switch paths: zb-h2, the searched zb-search cap=3 and Seq1F1B with 2
segments (same placement: a schedule swap; Seq1F1B's cuts the sequence from then on), zbv (V
placement), V-Half built for the measured costs and bitpipe (two replicas) through the checkpoint
rebuild (training/auto_schedule.py); and
a budget only Seq1F1B and the search under a cap below p fit (it starts on 2 segments and probes 4). With vocabulary
parallelism (every candidate carries the passes, whose measured times are the head's and the embedding's costs),
in the same launch: the own choice (GPT-2, tied), zb-h2 and the searched zb-search cap=3 (swaps; LLaMA, untied),
zbv (a rebuild that re-cuts the slices' Adam state; LLaMA), at lr 1e-3 as test_vocab_engine.py. At PP=2 x DP=2 (ZeRO-1 shards
re-cut across the switch): the own choice and zbv. A mixture of experts (tests/pipe/moe/test_moe_engine.py's) at PP=2: the
own choice and zbv, and the own choice of a model whose first layer is dense (rank 0's decision names the MoE layers and
costs each layer on its own)."""
import dataclasses

import pytest

from tests.gpt_harness import assert_matches_reference, reference_run, tiny_config
from tests.pipe.moe.test_moe_engine import MODELS
from tests.pipe.vocab.test_vocab_engine import LLAMA, LR

STEPS, LAYERS, GAS = 3, 4, 4
MOE = MODELS["softmax"]  # 8 experts, top-2, a shared expert, aux and z losses
BUDGET = 4  # every candidate fits at pp=2, m=4 (gpipe needs 4)
SEQ1F1B = "seq1f1b seq_splits=2 split_backward=True"
SWAPS = ("zb-h2", "zb-search cap=3", SEQ1F1B)  # placed as zb-h1
COSTED = "zbv-half op_costs"  # V-Half's order built for the measured costs (the label then names them)
CASES = [(None, BUDGET), ("zb-h2", BUDGET), ("zbv", BUDGET), ("bitpipe", BUDGET), ("zb-search cap=3", BUDGET),
         (SEQ1F1B, BUDGET), (COSTED, BUDGET), (None, 1.5)]  # 1.5: Seq1F1B (2 segments: 1.5 units, 4: 1.25) or zb-search cap=1.5
VOCAB_BUDGET = 6  # the passes' order may hold a micro-batch more in flight
MIXED = MODELS["sigmoid"]  # the first layer dense, the others MoE: the stages hold different mixes
MOE_CASES = [(None, BUDGET, MOE, False), ("zbv", BUDGET, MOE, False),
             (None, BUDGET, MIXED, False)]  # (label, budget, a MoE model, no vocab)
VOCAB_CASES = [(None, VOCAB_BUDGET, {}), ("zb-h2", VOCAB_BUDGET, LLAMA), ("zb-search cap=3", VOCAB_BUDGET, LLAMA),
               ("zbv", VOCAB_BUDGET, LLAMA)]  # (label, budget, the model of a vocabulary-parallel run)


def case_model(case):
    """(GPTConfig options, vocabulary parallel, lr) of a case: (label, budget) is the tiny GPT-2;
    (label, budget, model) a vocabulary-parallel run of `model`; (label, budget, model, False) `model` alone."""
    _, _, *rest = case
    vocab = rest[1] if len(rest) > 1 else bool(rest)
    return (rest[0], vocab, LR) if rest else ({}, False, 1e-2)


def forcing(label):
    """A rank-0 decision that ranks the candidates as usual, then picks `label`."""
    from megatron_ds.schedules import auto

    def choose(pp, m, layers, budget, measured, cuts, vocab_parallel=False, head_memory=0.0, overlap=False):
        decision = auto.decide(pp, m, layers, budget, measured, cuts, vocab_parallel=vocab_parallel,
                               head_memory=head_memory, overlap=overlap)  # a MoE model's verdict (pipe/auto.py)
        costs = dataclasses.replace(auto.model_costs(measured, pp), head_memory=head_memory)
        rows = auto.rank(pp, m, layers, budget, costs, measured.p2p, search=True, cuts=cuts,
                         vocab_parallel=vocab_parallel)
        row = next(r for r in rows if r["candidate"].label == label or label == COSTED
                   and r["candidate"].label.startswith(COSTED + "="))
        section = {"schedule": "zb-h1"} if row["search"] else row["candidate"].section()
        decision["choice"] = {"label": row["candidate"].label, "section": section, "search": row["search"],
                              "makespan": row["makespan"], "memory": row["memory"]}
        return decision
    return choose


def auto_rank_run(pp, gas, steps, cases):
    import deepspeed
    import torch.distributed as dist
    from megatron_ds.pipe.auto import AutoSwitch
    from megatron_ds.schedules import auto
    from megatron_ds.training.auto_schedule import switch_engine
    from tests.gpt_harness import (auto_engine_builder, capture_grads_before_reduce, ds_config, layer_key, micro_batch,
                                   whole_vocabulary, EVAL_STEP)
    deepspeed.init_distributed(dist_backend="gloo")
    dp = dist.get_world_size() // pp

    out = []
    for case in cases:
        label, budget = case[:2]
        model, vocab, lr = case_model(case)
        config = tiny_config(LAYERS, **model)

        build = auto_engine_builder(config, pp, dp, lr)

        AutoSwitch.choose = staticmethod(forcing(label) if label else auto.decide)
        pipeline = {"schedule": "auto", "memory_budget": budget, "timers_start_iter": 0, "timers_end_iter": 2,
                    "seq_split_method": "even", **({"vocab_parallel": True} if vocab else {})}
        engine = build(ds_config(pp, dp, gas, pipeline=pipeline, lr=lr))
        start, probe = (engine.plan.schedule.name, engine.plan.schedule.seq_splits), engine.auto.auto_plan.probe
        grads, losses, switched_at, reports = [], [], None, []
        engine.on_auto_decision = reports.append
        capture_grads_before_reduce(engine, grads)
        dp_rank = engine.grid.get_data_parallel_rank()
        for step in range(steps):
            batches = iter([micro_batch(step, dp_rank * gas + j) for j in range(gas)])
            losses.append(float(engine.train_batch(batches)))
            if reports and reports[-1].rebuild and switched_at is None:
                engine = switch_engine(engine, reports[-1].decision, build)
                switched_at = step
        weights = {layer_key(engine.module, n): p.detach().float().clone() for n, p in engine.module.named_parameters()}
        weights = whole_vocabulary(engine, config, weights)
        eval_batches = iter([micro_batch(EVAL_STEP, dp_rank * gas + j) for j in range(gas)])
        eval_loss = float(engine.eval_batch(eval_batches))
        now = engine.plan.schedule
        costs = reports[0].decision["costs"]
        out.append(dict(losses=losses, grads=whole_vocabulary(engine, config, grads[0]), weights=weights,
                        dp_rank=dp_rank, eval_loss=eval_loss, vocab_now=now.vocab_parallel,
                        vocab_costs=(costs["vocab_parallel"], costs["vocab"]),
                        start=start, probe=probe, now=(now.name, now.seq_splits), rebuilt_at=switched_at,
                        global_steps=engine.global_steps, auto_left=engine.auto is not None,
                        overhead=reports[0].decision["costs"]["op_overhead"], moe_layers=costs["moe_layers"],
                        layer_costs=costs["layers"],
                        op_sizes=reports[0].decision["costs"]["op_sizes"], choice=reports[0].decision["choice"],
                        reports=len(reports)))
    return out


@pytest.mark.parametrize("world,pp,cases", [(2, 2, CASES + VOCAB_CASES + MOE_CASES),
                                            (4, 2, [(None, BUDGET), ("zbv", BUDGET)])],
                         ids=["pp2", "pp2xdp2"])
def test_auto_switch_matches_reference(world, pp, cases):
    from megatron_ds.testing.launcher import run_ranks
    per_rank = run_ranks(world, auto_rank_run, pp, GAS, STEPS, cases, timeout=900)
    for i, case in enumerate(cases):
        label, budget = case[:2]
        model, vocab, lr = case_model(case)
        config = tiny_config(LAYERS, **model)
        ref = reference_run(config, world // pp, GAS, STEPS, lr=lr)
        results = [r[i] for r in per_rank]
        for r in results:
            on, passes = r["vocab_costs"]
            assert r["vocab_now"] == on == bool(vocab)  # every candidate, the choice included, has the passes
            # the head's and the embedding's costs are the passes' measured times (EF, S, T, EW beyond their
            # fixed part, which at this size is most of them)
            assert len(passes) == (4 if vocab else 0) and min(passes, default=0) >= 0
            # which layers have experts, as rank 0 learnt it from the ranks' modules; each layer's own costs
            flags = [int(config.is_moe_layer(i)) for i in range(1, LAYERS + 1)] if model.get("moe") else []
            assert r["moe_layers"] == flags and len(r["layer_costs"]) == len(flags)
            small = budget < 2
            assert r["start"] == (("seq1f1b", 2) if small else ("zb-h1", 1)), r["start"]
            assert r["probe"] == {"schedule": "seq1f1b", "seq_splits": 4, "split_backward": True}
            assert not r["auto_left"] and r["global_steps"] == STEPS and r["reports"] == 1  # the hook: once
            assert len(r["overhead"]) == 3 and min(r["overhead"]) > 0  # the runtime's time between ops, at least
            assert r["op_sizes"] == ([2, 4] if small else [1, 4])  # the start-up schedule's and the probe's
            if small:  # Seq1F1B, or zero-bubble's search under a cap below p
                assert r["choice"]["memory"] <= budget and r["now"][0] == r["choice"]["label"].split(" seq_splits")[0]
            if label:
                assert r["now"] == ((label.split()[0], 2) if label == SEQ1F1B else ("zbv-half" if label == COSTED else label, 1))
                if label == COSTED:
                    assert len(r["choice"]["section"]["op_costs"]) == 3
                assert r["rebuilt_at"] == (None if label in SWAPS else 1), (label, r["rebuilt_at"])
        try:
            assert_matches_reference(results, ref)
        except AssertionError as exc:
            raise AssertionError(f"auto -> {results[0]['now']}: {exc}") from None


def test_merge_takes_each_vocabulary_pass_as_the_median_over_the_slices():
    """Rank 0's merge of what every rank timed: F, B, W per stage, and under vocabulary parallelism each
    pass per slice (its stage), a micro-batch's time the sum over its segments."""
    from megatron_ds.pipe.auto import merge
    ms = 1e-3

    def rank(stage, passes):
        medians = {(kind, stage, 1, 0): t * ms for kind, t in (("F", 2.0), ("B", 3.0), ("W", 1.0))}
        medians.update({(kind, stage, 1, 0): t * ms for kind, t in passes.items()})
        return medians, [0.01 * ms], 0.0, ("host", 0, [])

    slices = [{"EF": 0.1, "S": 1.0, "T": 0.4, "EW": 0.2}, {"EF": 0.3, "S": 1.4, "T": 0.6, "EW": 0.2},
              {"EF": 0.2, "S": 1.2, "T": 0.5, "EW": 0.4}]
    measured = merge([rank(s, p) for s, p in enumerate(slices)], 3, [])
    assert measured.f == [2.0 * ms] * 3 and measured.vocab == pytest.approx((0.2 * ms, 1.2 * ms, 0.5 * ms, 0.2 * ms))
    assert merge([rank(s, {}) for s in range(3)], 3, []).vocab == ()  # no passes: the ends' excess, as before


def test_a_moe_models_stages_and_all_to_all_as_rank_0_takes_them():
    """Single process: which layers of each stage have experts (from the module's layer specs and cut, and the
    MoE layers the ranks hold), a MoE layer's FLOPs over a dense one's, and each stage's all-to-all time
    (the median over the ranks, a micro-batch's sum over its segments, at the op size the times are kept at)."""
    from types import SimpleNamespace

    from megatron_ds.model.gpt import gpt_layer_specs
    from megatron_ds.pipe.auto import inside, layer_kinds, moe_flops, with_experts
    from megatron_ds.pipe.plan.partition import layer_flops
    from megatron_ds.schedules import measurement

    config = tiny_config(6, **{**MOE, "moe": dataclasses.replace(MOE["moe"], layer_freq=(1, 0, 0, 1, 1, 0))})
    module = SimpleNamespace(_layer_specs=gpt_layer_specs(config), parts=[0, 3, 5, 9])  # [emb, 1, 2], [3, 4], [5, 6, norm, head]
    experts = {1, 4, 5}  # MoE.layer_idx: the global pipeline index
    assert layer_kinds(module, experts) == ((1, 0), (0, 1), (1, 0))
    flops = layer_flops(config)
    assert moe_flops(module, ((1, 0), (0, 1), (1, 0))) == pytest.approx(flops[1] / flops[2]) and flops[1] > flops[2]
    assert inside(sorted([(0.0, 1.0), (2.0, 2.5), (2.9, 3.2), (5.0, 6.0)]), 2.0, 3.0) == pytest.approx(0.6)
    measured = measurement.Measured([1.0] * 3, [1.0] * 3, [1.0] * 3, op_sizes=(1, 4))
    comm = [{("F", 0, 1, 0): 0.2, ("B", 0, 1, 0): 0.1, ("F", 1, 1, 0): 0.4, ("F", 1, 4, 0): 9.0},  # a DP pair's
            {("F", 0, 1, 0): 0.4, ("B", 0, 1, 0): 0.3, ("F", 1, 1, 0): 0.4, ("F", 2, 1, 0): 0.1, ("F", 2, 1, 1): 0.2}]
    out = with_experts(measured, module, experts, comm)
    assert out.layer_kinds == ((1, 0), (0, 1), (1, 0)) and out.moe_flops == pytest.approx(flops[1] / flops[2])
    assert [list(t) for t in out.all_to_all] == [[pytest.approx(0.3), pytest.approx(0.2)], [0.4, 0.0],
                                                 [pytest.approx(0.3), 0.0]]
    assert with_experts(measured, module, set(), comm) == measured  # a dense model: as before
