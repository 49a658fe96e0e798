"""Op traces (megatron_ds/pipe/trace.py).

A 2-rank run with "pipeline.trace_dir" set writes one valid Chrome trace per rank and
iteration whose compute events are the schedule's ops, in order, at increasing times; the
stock DeepSpeed engine is traced the same way; tools/trace_to_png.py draws them.
"""
import json
import os

import pytest
import torch

from megatron_ds.testing.timed import TimedCosts
from megatron_ds.testing.launcher import run_ranks

PP, GAS, LAYERS, MBS, SEQ, HIDDEN = 2, 4, 4, 2, 8, 16
STEPS = 2
PIPELINES = {"zbv": {"schedule": "zbv"}, "stock": {}}


def _rank_run(root):
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    from megatron_ds.model import GPTConfig
    from megatron_ds.testing.timed import timed_layer_specs, timed_loss
    from megatron_ds.pipe.build import build_pipeline_module, initialize_engine
    shape = GPTConfig(vocab_size=1, hidden_size=HIDDEN, num_layers=LAYERS, num_attention_heads=1,
                      max_position_embeddings=SEQ)
    costs = TimedCosts(tf=0.002, tb=0.002, tw=0.002)
    g = torch.Generator().manual_seed(0)
    data = [((torch.randn(MBS, SEQ, HIDDEN, generator=g),), torch.randn(MBS, SEQ, HIDDEN, generator=g))
            for _ in range(GAS)]
    kinds = {}
    for name, pipeline in PIPELINES.items():
        cfg = {"train_micro_batch_size_per_gpu": MBS, "gradient_accumulation_steps": GAS, "gradient_clipping": 0.0,
               "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9,
               "pipeline": dict(pipeline, partition_method="uniform", trace_dir=os.path.join(root, name))}
        module = build_pipeline_module(shape, cfg, PP, layers=timed_layer_specs(LAYERS, HIDDEN, costs),
                                       loss_fn=timed_loss)
        engine = initialize_engine(module, cfg, optimizer=torch.optim.SGD(module.parameters(), lr=1e-3))
        for _ in range(STEPS):
            engine.train_batch(iter(data))
        engine.eval_batch(iter(data))  # not traced
        kinds[name] = type(engine).__name__
    return kinds


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("traces"))
    engines = run_ranks(PP, _rank_run, root, timeout=300)
    return root, engines[0]


def _load(path):
    with open(path) as fh:
        return json.load(fh)


@pytest.mark.parametrize("name", list(PIPELINES))
def test_every_rank_writes_a_chrome_trace_per_iteration(traced, name):
    from megatron_ds.schedules.timeline import trace_path
    root, engines = traced
    assert engines[name].startswith("Traced") or engines[name] == "ScheduleEngine"
    assert sorted(os.listdir(os.path.join(root, name))) == sorted(
        os.path.basename(trace_path("", s, r)) for s in range(STEPS) for r in range(PP))  # nothing for eval
    for step in range(STEPS):
        for rank in range(PP):
            doc = _load(trace_path(os.path.join(root, name), step, rank))
            assert doc["otherData"]["rank"] == rank and doc["otherData"]["step"] == step
            events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
            assert {e["pid"] for e in doc["traceEvents"]} == {rank}
            assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in events)
            names = {e["name"] for e in events}
            assert "OptimizerStep" in names and "ReduceGrads" in names
            for tid in (0, 1, 2):  # events of one thread never overlap
                lane = sorted((e for e in events if e["tid"] == tid), key=lambda e: e["ts"])
                for a, b in zip(lane, lane[1:]):
                    assert a["ts"] + a["dur"] <= b["ts"] + 1e-3, (a, b)


@pytest.mark.parametrize("name,schedule", [("zbv", "zbv"), ("stock", "1f1b")])
def test_compute_events_are_the_schedule_ops_in_order(traced, name, schedule):
    from megatron_ds.schedules.timeline import load_iteration, measure
    from megatron_ds.schedules import build_schedule
    root, _ = traced
    expected = build_schedule(schedule, PP, GAS)
    for step in range(STEPS):
        traces = load_iteration(os.path.join(root, name), step)
        for rank, t in enumerate(traces):
            ops = t.compute_ops()
            assert [op for op, _, _ in ops] == expected.ranks[rank]
            times = [x for _, s, e in ops for x in (s, e)]
            assert times == sorted(times)
            # each compute op sleeps 2 ms per layer at least
            assert all(e - s >= 0.002 for _, s, e in ops)
        m = measure(traces)
        assert 0 <= m.bubble_ratio < 1 and m.makespan <= m.span


def test_receive_waits_are_their_own_events(traced):
    from megatron_ds.schedules.timeline import load_iteration
    root, _ = traced
    t = load_iteration(os.path.join(root, "zbv"), 1)[1]  # stage 1 waits for stage 0's activations
    waits = [e for e in t.of("p2p") if e["name"] == "recv act"]
    assert len(waits) == GAS
    forwards = [e for e in t.of("compute") if e["args"]["kind"] == "F" and e["args"]["stage"] == 1]
    for w, f in zip(waits, forwards):  # the forward starts once its input is in
        assert w["ts"] + w["dur"] <= f["ts"] + 1e-9


def test_trace_to_png_merges_ranks_and_draws_both_timelines(traced, tmp_path):
    from tools.trace_to_png import main
    root, _ = traced
    png, merged = tmp_path / "zbv.png", tmp_path / "zbv.json"
    assert main([os.path.join(root, "zbv"), "--out", str(png), "--merged", str(merged),
                 "--tf", "4", "--tb", "4", "--tw", "4"]) == 0
    assert png.stat().st_size > 1000
    doc = _load(merged)
    assert {e["pid"] for e in doc["traceEvents"]} == set(range(PP))
