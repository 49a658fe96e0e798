"""Overlapped units (pipe/moe/overlap.py): the engine runs a unit's F and B or BW with each side's all-to-all
in flight while the other computes, and trains bit for bit as the same op list run one op after the other.

A MoE GPT (a dense first layer, dropout on, expert parallelism 2 over the data-parallel ranks) trains 3 steps
under `"overlap": true` and under its plain form: dualpipev's plain order is its overlapped one, 1f1b's and
interleaved's overlapped orders are other lists, run plain from a schedule file of the same ops without the units.
Losses, every first-step gradient and the weights after the steps are torch.equal, at PP2 x DP2 and PP4 x DP2,
with selective and full recompute, DeepSpeed's activation_checkpoint_interval, dualpipev's B/W split,
post-validation, and TP 2 with sequence parallelism. With the test latency set, units hide what the shorter side
of each can (counted: model/moe_dispatch.AddedLatency), the plain run nothing, and the traces mark the units.
The baton itself is tested without processes: the sides alternate at each hand-over, each keeping its own state
(the latency's deadline: tests/model/test_moe_dispatch.py).
"""
import dataclasses
import os
import threading

import pytest
import torch

from megatron_ds.model.moe_dispatch import InFlight
from megatron_ds.moe_config import MoEConfig
from megatron_ds.pipe.plan.config import ConfigError, pipeline_settings
from megatron_ds.pipe.moe.overlap import OverlapRunner
from megatron_ds.schedules import build_schedule
from megatron_ds.schedules.timeline import first_pipeline, load_iteration
from megatron_ds.testing.launcher import run_ranks
from tests.gpt_harness import PACKED, engine_rank_run, packed_micro_batch

GAS, STEPS, LR = 4, 3, 1e-3
LATENCY_MS = 50


def model(layers, ep=2, dense_first=True, **extra):
    moe = MoEConfig(num_experts=4, router_topk=2, shared_expert_intermediate_size=16, aux_loss_coeff=0.01,
                    z_loss_coeff=0.001, layer_freq=(int(not dense_first),) + (1,) * (layers - 1),
                    expert_model_parallel_size=ep)
    return dict(normalization="rmsnorm", swiglu=True, position_embedding_type="rope", add_bias_linear=False,
                ffn_hidden_size=24, hidden_dropout=0.1, attention_dropout=0.1, moe=moe, **extra)


SELECTIVE = dict(recompute_granularity="selective")
ONE_SCHEDULE = ("interval", "post-validation")  # cases run under dualpipev alone
FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def plain_file(tmp_path, name, pp, knobs):
    """A file holding `name`'s overlapped order for pp ranks without its units: the same ops, run one by one."""
    schedule = build_schedule(name, pp, GAS, overlap=True, **knobs)
    assert schedule.overlap, name
    path = tmp_path / f"{name}_pp{pp}_plain.json"
    path.write_text(dataclasses.replace(schedule, overlap=None).to_json())
    return f"file:{path}"


def pairs(tmp_path, pp):
    """(label, plain section, overlapped section) of each schedule that takes overlap at `pp`."""
    out = [("dualpipev", {"schedule": "dualpipev"}, {"schedule": "dualpipev", "overlap": True})]
    for name, knobs in (("1f1b", {}), ("interleaved", {"virtual_stages": 2})):
        out.append((name, {"schedule": plain_file(tmp_path, name, pp, knobs)},
                    {"schedule": name, "overlap": True, **knobs}))
    return out


def cases_for(tmp_path, pp, layers, extras):
    """(label, section, model options) pairs, plain then overlapped, for each schedule and each extra."""
    cases = []
    for label, plain, over in pairs(tmp_path, pp):
        for extra_label, section, options in extras:
            if extra_label in ONE_SCHEDULE and label != "dualpipev":
                continue
            for pipeline in (plain, over):
                cases.append((f"{label} {extra_label}", {**pipeline, **section}, model(layers, **options)))
    return cases


def seeded():
    """The dropout generators seeded alike before each run (the harness leaves them where the last run did)."""
    import deepspeed
    import torch.distributed as dist
    from megatron_ds.model.tensor_parallel import model_parallel_manual_seed
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
    model_parallel_manual_seed(1234, dist.get_rank())


def rank_runs(pp, layers, cases):
    out = []
    for _, pipeline, options in cases:
        seeded()
        options = dict(options)
        packed = options.pop("packed", False)  # packed documents' batches
        r = engine_rank_run(pp, GAS, STEPS, pipeline, num_layers=layers, lr=LR,
                            model={**options, **PACKED} if packed else options,
                            batch=packed_micro_batch if packed else None)
        out.append({k: r[k] for k in ("losses", "grads", "weights", "eval_loss")})
    return out


def assert_bit_equal(per_rank, cases):
    failures = []
    for i in range(0, len(cases), 2):
        label = cases[i][0]
        for rank, runs in enumerate(per_rank):
            plain, over = runs[i], runs[i + 1]
            if plain["losses"] != over["losses"] or plain["eval_loss"] != over["eval_loss"]:
                failures.append(f"{label} rank {rank}: losses {plain['losses']} != {over['losses']}")
            for what in ("grads", "weights"):
                assert plain[what].keys() == over[what].keys(), (label, what)
                bad = [k for k in plain[what] if not torch.equal(plain[what][k], over[what][k])]
                if bad:
                    failures.append(f"{label} rank {rank}: {what} differ at {bad[:3]} ({len(bad)} of {len(plain[what])})")
    assert not failures, "\n".join(failures)


def latency_runs(pp, layers, trace_dir):
    """One step of dualpipev plain, then overlapped (traced), with the test latency set: per run (seconds the
    latency added, seconds slept, seconds the units could hide: per unit the shorter side's all-to-alls, and
    (units the engine ran, units the rank's list holds))."""
    import torch.distributed as dist
    import deepspeed
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
    from megatron_ds.model.moe import MoE
    from megatron_ds.model.moe_dispatch import TEST_LATENCY_ENV, AddedLatency
    from megatron_ds.pipe.build import build_pipeline_module, initialize_engine
    from tests.gpt_harness import ds_config, micro_batch, optimizer_for, tiny_config
    config = tiny_config(layers, **model(layers, dense_first=False))  # a MoE layer on each side of every unit
    out = []
    for pipeline in ({"schedule": "dualpipev"}, {"schedule": "dualpipev", "overlap": True, "trace_dir": trace_dir}):
        cfg = ds_config(pp, dist.get_world_size() // pp, GAS, pipeline=pipeline, lr=LR)
        module = build_pipeline_module(config, cfg, pp, 0)
        engine = initialize_engine(module, cfg, optimizer=optimizer_for(module.named_parameters(), LR))
        moe = {c: sum(isinstance(m, MoE) for f in module.chunk_funcs[c] if isinstance(f, torch.nn.Module)
                      for m in f.modules()) for c in module.chunks}
        hideable = 0
        for unit in engine.plan.schedule.units(engine.stage_id):
            if len(unit) == 2:
                f, b = sorted(unit, key=lambda op: op.kind != "F")
                hideable += min(3 * moe[(f.replica, f.stage)], 2 * moe[(b.replica, b.stage)])  # dispatch: 3 F, 2 B
        dp_rank = engine.grid.get_data_parallel_rank()
        batches = iter([micro_batch(0, dp_rank * GAS + j, config.vocab_size) for j in range(GAS)])
        os.environ[TEST_LATENCY_ENV] = str(LATENCY_MS)
        AddedLatency.added = AddedLatency.slept = 0.0
        try:
            engine.train_batch(batches)
        finally:
            os.environ.pop(TEST_LATENCY_ENV)
        planned = len((engine.plan.schedule.overlap or [[]] * pp)[engine.stage_id])
        out.append((AddedLatency.added, AddedLatency.slept, hideable * LATENCY_MS / 1e3,
                    (engine.overlapped_units_run, planned)))
    return out


def pp2_runs(pp, layers, cases, trace_dir):
    return rank_runs(pp, layers, cases), latency_runs(pp, layers, trace_dir)


def test_overlapped_units_train_bit_for_bit_as_their_plain_order_at_pp2_dp2(tmp_path):
    extras = [("", {}, {}), ("selective", {}, SELECTIVE), ("full", {}, FULL),
              ("interval", {"activation_checkpoint_interval": 1}, {}),
              ("post-validation", {"post_validation": True}, {"ep": 1}),  # post-validation refuses EP
              ("documents", {}, {**SELECTIVE, "packed": True})]  # the recomputed core reads the B's documents
    cases = cases_for(tmp_path, 2, 4, extras)
    trace_dir = str(tmp_path / "traces")
    per_rank = run_ranks(4, pp2_runs, 2, 4, cases, trace_dir, timeout=1500)
    assert_bit_equal([r[0] for r in per_rank], cases)
    for rank, (_, latency) in enumerate(per_rank):
        (added, slept, _, plain_units), (over_added, over_slept, hideable, units) = latency
        assert plain_units == (0, 0) and units[0] == units[1] > 0, (rank, plain_units, units)  # every unit ran once
        assert added > 0 and added - slept < 0.02 * added, (rank, added, slept)  # blocking: every bit waited
        assert hideable > 0 and over_added == pytest.approx(added), (rank, hideable, over_added, added)
        hidden = over_added - over_slept
        assert hidden >= hideable / 2, f"rank {rank}: units hid {hidden:.3f} s of the {hideable:.3f} s they can"
    schedule = build_schedule("dualpipev", 2, GAS, overlap=True)
    traces = first_pipeline(load_iteration(trace_dir))
    assert [t.overlap_positions() for t in sorted(traces, key=lambda t: t.meta["stage_id"])] == schedule.overlap


def test_overlapped_units_train_bit_for_bit_at_pp4_dp2_and_under_tensor_parallelism(tmp_path):
    """8 ranks: PP4 x DP2 (8 layers: dualpipev's 8 virtual stages), and TP2 x PP2 x DP2 with sequence parallelism."""
    cases = [(f"pp4 {label}", c, o) for label, c, o in cases_for(tmp_path, 4, 8, [("", {}, {}), ("selective", {}, SELECTIVE)])]
    tp = [(f"tp2 sp {label}", section, model(4, tensor_model_parallel_size=2, sequence_parallel=True))
          for label, *sections in pairs(tmp_path, 2)[:2] for section in sections]
    per_rank = run_ranks(8, both_topologies, cases, tp, timeout=1800)
    assert_bit_equal([r[0] for r in per_rank], cases)
    assert_bit_equal([r[1] for r in per_rank], tp)


def both_topologies(pp4, tp):
    return rank_runs(4, 8, pp4), rank_runs(2, 4, tp)


# -- the ds_config key ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule", ["1f1b", "interleaved", "dualpipev"])
def test_the_key_builds_the_overlapped_order(schedule):
    settings = pipeline_settings({"pipeline": {"schedule": schedule, "overlap": True}})
    assert settings.build_schedule(2, GAS).overlap == build_schedule(schedule, 2, GAS, overlap=True).overlap
    assert settings.compiles_layers(cuda=True, splits_ops=False) is False  # units run eager
    assert pipeline_settings({"pipeline": {"schedule": schedule}}).build_schedule(2, GAS).overlap is None


@pytest.mark.parametrize("section, message", [
    ({"schedule": "zbv", "overlap": True}, 'overlap" = true with "schedule": "zbv": overlapped .* 1f1b, interleaved, '
                                           "dualpipev"),
    ({"schedule": "deepspeed", "overlap": True}, 'with "schedule": "deepspeed"'),
    ({"schedule": "auto", "memory_budget": 4, "overlap": True}, '"auto" weighs them itself'),
    ({"schedule": "1f1b", "overlap": "yes"}, "must be true or false"),
    ({"schedule": "1f1b", "overlap": True, "vocab_parallel": True}, "vocabulary passes are not placed"),
    ({"schedule": "dualpipev", "overlap": True, "compile_layers": True}, "compile_layers.*eagerly"),
])
def test_the_key_is_refused_where_units_cannot_run(section, message):
    with pytest.raises(ConfigError, match=message):
        pipeline_settings({"pipeline": section})


def test_a_schedule_file_with_units_runs_them_unless_it_has_segments(tmp_path):
    schedule = build_schedule("1f1b", 2, GAS, overlap=True)
    path = tmp_path / "units.json"
    path.write_text(schedule.to_json())
    settings = pipeline_settings({"pipeline": {"schedule": f"file:{path}"}})
    assert settings.build_schedule(2, GAS).overlap == schedule.overlap and settings.overlap  # eager, as the key's
    assert not settings.compiles_layers(cuda=True, splits_ops=False)
    with pytest.raises(ConfigError, match="the file fixes the op order.*remove overlap"):
        pipeline_settings({"pipeline": {"schedule": f"file:{path}", "overlap": True}})
    segments = build_schedule("seq1f1b", 2, GAS, seq_splits=2)
    path.write_text(dataclasses.replace(segments, overlap=[[], [3]]).to_json())
    with pytest.raises(ConfigError, match="overlapped units and sequence segments"):
        pipeline_settings({"pipeline": {"schedule": f"file:{path}"}})


# -- the baton, without processes -------------------------------------------------------------------------------

class Sides:
    """Two sides that log their steps and hand over between them, each setting and then checking `state`."""

    def __init__(self):
        self.log, self.state = [], {"holder": None}
        self.threads = set()

    def side(self, name, steps):
        def run():
            self.threads.add(threading.current_thread().name)
            self.state["holder"] = name
            for i in range(steps):
                self.log.append(f"{name}{i}")
                if i < steps - 1:
                    InFlight.meanwhile()
                    assert self.state["holder"] == name, f"{name} came back to {self.state['holder']}'s state"
            return name
        return run

    def runner(self):
        return OverlapRunner(lambda: dict(self.state), lambda saved: self.state.update(saved))


@pytest.mark.parametrize("backward_first", [False, True])
def test_the_sides_alternate_at_each_hand_over_each_with_its_own_state(backward_first):
    sides = Sides()
    runner = sides.runner()
    out = runner.run(sides.side("f", 3), sides.side("b", 2), backward_first)
    assert out == "f" and InFlight.meanwhile is None
    assert sides.log == (["b0", "f0", "b1", "f1", "f2"] if backward_first else ["f0", "b0", "f1", "b1", "f2"])
    assert sides.state["holder"] == "f"  # the forward side's state is left
    assert len(sides.threads) == 2
    sides.log.clear()
    runner.run(sides.side("f", 1), sides.side("b", 3), False)  # the kept thread serves the next unit
    assert sides.log == ["f0", "b0", "b1", "b2"] and len(sides.threads) == 2


@pytest.mark.parametrize("failing", ["f", "b"])
def test_a_failing_side_lets_the_other_finish_and_its_error_is_raised(failing):
    sides = Sides()

    def fail():
        InFlight.meanwhile()
        raise ValueError(f"{failing} failed")
    forward = fail if failing == "f" else sides.side("f", 3)
    backward = fail if failing == "b" else sides.side("b", 3)
    with pytest.raises(ValueError, match=f"{failing} failed"):
        sides.runner().run(forward, backward, False)
    assert len(sides.log) == 3 and InFlight.meanwhile is None
