"""`"schedule": "auto"` on ScheduleEngine: it times two iterations on its start-up schedule (zb-h1),
decides, switches, and the run equals the single-process reference through the switch: losses of
3 steps, every gradient of the first step, the weights after 3 optimizer steps and the eval loss,
fp32 1e-5. At PP=2 one launch runs five cases: the engine's own choice, and three forced choices
that cover both switch paths: zb-h2 and the searched zb-search cap=3 (same placement: a schedule
swap), zbv (V placement) and bitpipe (two replicas) through the checkpoint rebuild
(training/auto_switch.py). At PP=2 x DP=2
(ZeRO-1 shards re-cut across the switch): the own choice and zbv."""
import pytest

from tests.gpt_harness import assert_matches_reference, reference_run, tiny_config

STEPS, LAYERS, GAS = 3, 4, 4
FORCED = [None, "zb-h2", "zbv", "bitpipe", "zb-search cap=3"]
BUDGET = 4  # every candidate fits at pp=2, m=4 (gpipe needs 4)


def forcing(label):
    """A rank-0 decision that ranks the candidates as usual, then picks `label`."""
    from megatron_ds.schedules import auto

    def choose(pp, m, layers, budget, measured):
        decision = auto.decide(pp, m, layers, budget, measured)
        rows = auto.rank(pp, m, layers, budget, auto.model_costs(measured, pp), measured.p2p, search=True)
        row = next(r for r in rows if r["candidate"].label == label)
        section = {"schedule": "zb-h1"} if row["search"] else row["candidate"].section()
        decision["choice"] = {"label": label, "section": section, "search": row["search"],
                              "makespan": row["makespan"], "memory": row["memory"]}
        return decision
    return choose


def auto_rank_run(pp, gas, steps, forced_labels):
    import deepspeed
    import torch.distributed as dist
    from megatron_ds.pipe.auto import AutoSwitch
    from megatron_ds.pipe.build import build_pipeline_module, initialize_engine
    from megatron_ds.schedules import auto
    from megatron_ds.training.auto_switch import switch_engine
    from tests.gpt_harness import capture_grads_before_reduce, ds_config, layer_key, micro_batch, optimizer_for, EVAL_STEP
    deepspeed.init_distributed(dist_backend="gloo")
    config = tiny_config(LAYERS)
    dp = dist.get_world_size() // pp

    def build(cfg):
        module = build_pipeline_module(config, cfg, pp)
        return initialize_engine(module, cfg, optimizer=optimizer_for(module.named_parameters()))

    out = []
    for label in forced_labels:
        AutoSwitch.choose = staticmethod(forcing(label) if label else auto.decide)
        pipeline = {"schedule": "auto", "memory_budget": BUDGET, "timers_start_iter": 0, "timers_end_iter": 2}
        engine = build(ds_config(pp, dp, gas, pipeline=pipeline))
        start = engine.plan.schedule.name
        grads, losses, switched_at = [], [], None
        capture_grads_before_reduce(engine, grads)
        dp_rank = engine.grid.get_data_parallel_rank()
        for step in range(steps):
            batches = iter([micro_batch(step, dp_rank * gas + j) for j in range(gas)])
            losses.append(float(engine.train_batch(batches)))
            if engine.pending_switch:
                engine = switch_engine(engine, build)
                switched_at = step
        weights = {layer_key(engine.module, n): p.detach().float().clone() for n, p in engine.module.named_parameters()}
        eval_batches = iter([micro_batch(EVAL_STEP, dp_rank * gas + j) for j in range(gas)])
        eval_loss = float(engine.eval_batch(eval_batches))
        out.append(dict(losses=losses, grads=grads[0], weights=weights, dp_rank=dp_rank, eval_loss=eval_loss,
                        start=start, now=engine.plan.schedule.name, rebuilt_at=switched_at,
                        global_steps=engine.global_steps, auto_left=engine.auto is not None))
    return out


@pytest.mark.parametrize("world,pp,forced", [(2, 2, FORCED), (4, 2, [None, "zbv"])], ids=["pp2", "pp2xdp2"])
def test_auto_switch_matches_reference(world, pp, forced):
    from megatron_ds.testing.launcher import run_ranks
    ref = reference_run(tiny_config(LAYERS), world // pp, GAS, STEPS)
    per_rank = run_ranks(world, auto_rank_run, pp, GAS, STEPS, forced, timeout=900)
    for i, label in enumerate(forced):
        results = [r[i] for r in per_rank]
        for r in results:
            assert r["start"] == "zb-h1" and not r["auto_left"] and r["global_steps"] == STEPS
            if label:
                assert r["now"] == label
                swap = label in ("zb-h2", "zb-search cap=3")
                assert r["rebuilt_at"] == (None if swap else 1), (label, r["rebuilt_at"])
        try:
            assert_matches_reference(results, ref)
        except AssertionError as exc:
            raise AssertionError(f"auto -> {results[0]['now']}: {exc}") from None
