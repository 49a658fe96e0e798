"""training/auto_schedule.py without processes: which saved "auto" decisions a resumed run reuses (the
same pp, micro-batch count, layers, budget, sizes, precision, device and candidates), the one line it
logs either way, the record file (atomic, removed from a reused tag folder), and a searched zb-search
choice rebuilt on a plan after the build. The launch test is test_auto_schedule_launch.py."""
import json
import os
from types import SimpleNamespace

import pytest

from megatron_ds.pipe.auto import chosen_ds_config
from megatron_ds.pipe.plan.config import ConfigError, pipeline_settings
from megatron_ds.pipe.plan.plan import make_plan
from megatron_ds.schedules import auto
from megatron_ds.pipe.auto import AutoDecision
from megatron_ds.training.auto_schedule import (FORMAT, NAME, AutoSchedule, differences, read_record, resume_choice,
                                                run_key)
from megatron_ds.training.checkpoint.save_load import write_step_file

SIZES = SimpleNamespace(num_layers=8, hidden_size=32, ffn_hidden_size=128, max_position_embeddings=16,
                        num_attention_heads=4)
PP, M = 4, 8


def ds(**pipeline):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": M, "zero_optimization": {"stage": 1},
            "pipeline": {"schedule": "auto", "memory_budget": 6, **pipeline}}


def key_for(cfg, sizes=SIZES, pp=PP, device="cpu"):
    return run_key(*make_plan(sizes, cfg, pp, 1), sizes, cfg, device)


def decision(budget=6.0):
    """A real decision at unit costs with zb_search's schedules offered (the choice is a searched one)."""
    return auto.decide(PP, M, SIZES.num_layers, budget, auto.Measured([1.0] * PP, [1.0] * PP, [0.5] * PP))


def saved(tmp_path, key, dec=None, iteration=10, decided_at=4):
    step = tmp_path / f"global_step{iteration}"
    step.mkdir(exist_ok=True)
    write_step_file(str(step), NAME, {"format": FORMAT, "iteration": iteration, "decided_at": decided_at, "key": key,
                                      "decision": dec or decision()})
    return str(step)


def test_the_same_run_reuses_the_decision(tmp_path):
    key = key_for(ds())
    dec = decision()
    step = saved(tmp_path, key, dec)
    assert json.loads(json.dumps(key)) == key and not differences(key, key)
    record, line = resume_choice(step, key_for(ds(timers_end_iter=9)))  # the timed window is no reason
    assert record["decision"] == dec
    assert line.startswith(f"auto schedule: {dec['choice']['label']} from the checkpoint of iteration 10 "
                           "(decided at iteration 4); simulated makespan ")
    assert not [f for f in os.listdir(step) if f != NAME]  # no temp file left


@pytest.mark.parametrize("cfg,sizes,pp,device,why", [
    (ds(memory_budget=5), SIZES, PP, "cpu", '"memory_budget" (micro-batches of one stage\'s activations) 6 then, 5 now'),
    ({**ds(), "gradient_accumulation_steps": 12}, SIZES, PP, "cpu", "micro-batches per step 8 then, 12 now"),
    (ds(), SIZES, 2, "cpu", "pipeline stages 4 then, 2 now"),
    (ds(), SimpleNamespace(**{**vars(SIZES), "num_layers": 16}), PP, "cpu", "--num-layers 8 then, 16 now"),
    (ds(), SimpleNamespace(**{**vars(SIZES), "hidden_size": 64}), PP, "cpu", "--hidden-size 32 then, 64 now"),
    ({**ds(), "bf16": {"enabled": True}}, SIZES, PP, "cpu", "precision fp32 then, bf16 now"),
    (ds(), SIZES, PP, "NVIDIA H100", "device cpu then, NVIDIA H100 now"),
    (ds(), SimpleNamespace(**{**vars(SIZES), "vocab_size": 256000}), PP, "cpu",
     "padded vocabulary 50304 then, 256000 now"),  # the head's cost is part of what was timed
    (ds(vocab_parallel=True), SIZES, PP, "cpu", '"vocab_parallel" False then, True now'),  # other candidates
])
def test_another_run_times_again(tmp_path, cfg, sizes, pp, device, why):
    step = saved(tmp_path, key_for(ds()))
    record, line = resume_choice(step, key_for(cfg, sizes, pp, device))
    assert record is None and line.startswith("auto schedule: timing again: the checkpoint of iteration 10 chose ")
    assert line.endswith(why) and "\n" not in line


def test_other_candidates_time_again(tmp_path):
    key = key_for(ds())
    old = {**key, "candidates": [c for c in key["candidates"] if c != "zbv"] + ["retired"]}
    record, line = resume_choice(saved(tmp_path, old), key)
    assert record is None and line.endswith("candidate schedules differ (now also zbv) (no longer retired)")


def test_a_record_from_before_vocabulary_parallelism_reads_as_without(tmp_path):
    key = key_for(ds())
    older = {k: v for k, v in key.items() if k != "vocab_parallel"}  # saved before the key existed
    assert resume_choice(saved(tmp_path, older), key)[0] is not None
    record, line = resume_choice(saved(tmp_path, older), key_for(ds(vocab_parallel=True)))
    assert record is None and '"vocab_parallel" False then, True now' in line


def test_budget_in_bytes_compares_in_units(tmp_path):
    sizes = SimpleNamespace(**vars(SIZES), vocab_size=64)
    one = key_for(ds(memory_budget="1081344B"), sizes)  # 6 units of 180224 bytes at pp=4 (fp32)
    assert one["budget"] == pytest.approx(6.0)
    assert resume_choice(saved(tmp_path, key_for(ds(), sizes)), one)[0] is not None


@pytest.mark.parametrize("kw,why", [
    (dict(remeasure=True), 'timing again ("remeasure": true); the checkpoint of iteration 10 had chosen '),
    (dict(universal=True), "timing again: a universal checkpoint loads under another layout"),
    (dict(finetune=True), "timing again: --finetune starts a new run"),
])
def test_forced_to_time_again(tmp_path, kw, why):
    key = key_for(ds())
    record, line = resume_choice(saved(tmp_path, key), key, **kw)
    assert record is None and why in line


def test_no_or_bad_record(tmp_path):
    key = key_for(ds())
    step = tmp_path / "global_step1"
    step.mkdir()
    assert resume_choice(str(step), key) == (None, "auto schedule: timing again: checkpoint global_step1 holds no "
                                                   "decision (saved before the timed iterations ended)")
    (step / NAME).write_text("{not json")
    record, line = resume_choice(str(step), key)
    assert record is None and "cannot be read" in line
    (step / NAME).write_text(json.dumps({"format": 99}))
    with pytest.raises(ValueError, match="not a format-1 auto schedule record"):
        read_record(str(step))
    write_step_file(str(step), NAME, None)  # a save before the decision into a reused tag folder
    assert not (step / NAME).exists() and read_record(str(step)) is None


def test_remeasure_is_checked():
    assert pipeline_settings(ds(remeasure=True)).remeasure
    with pytest.raises(ConfigError, match=r'"pipeline.remeasure" = 1: must be true or false'):
        pipeline_settings(ds(remeasure=1))
    with pytest.raises(ConfigError, match=r'remeasure apply to "schedule": "auto" only'):
        pipeline_settings({"pipeline": {"schedule": "zb-h1", "remeasure": True}})
    assert "remeasure" not in chosen_ds_config(ds(remeasure=True), decision())["pipeline"]


def searched_decision():
    """decision() with its choice the fastest zb-search schedule (as pipe/auto.py broadcasts one)."""
    dec = decision()
    costs = auto.model_costs(auto.Measured([1.0] * PP, [1.0] * PP, [0.5] * PP), PP)
    row = next(r for r in auto.rank(PP, M, SIZES.num_layers, 6.0, costs, search=True) if r["search"])
    dec["choice"] = {"label": row["candidate"].label, "section": {"schedule": "zb-h1"}, "search": row["search"],
                     "makespan": row["makespan"], "memory": row["memory"]}
    return json.loads(json.dumps(dec))  # as read back from the file


def test_searched_choice_is_switched_after_the_build():
    dec = searched_decision()
    choice = dec["choice"]
    plan, auto_plan = make_plan(SIZES, chosen_ds_config(ds(), dec), PP, 1)
    assert plan.schedule.name == "zb-h1" and auto_plan is None
    holder = AutoSchedule({}, {"decision": dec, "decided_at": 4})
    engine = SimpleNamespace(plan=plan)
    engine.use_plan = lambda new: setattr(engine, "plan", new)  # the placement check: test_use_plan_* (pipe)
    holder.resume_search(engine)
    want = auto.zb_search(PP, M, **choice["search"])
    assert engine.plan.schedule.name == choice["label"] and engine.plan.schedule.ranks == want.ranks
    assert plan.schedule.name == "zb-h1"  # the build's plan is not changed: the engine holds a new one


def test_the_trainer_saves_the_decision_in_force(tmp_path):
    """The engine reports through its hook; the checkpoint of the iteration that ended then and every later
    one hold the decision (decided at that iteration), and the file reads back."""
    holder = AutoSchedule({"pp": 2})
    engine = SimpleNamespace(on_auto_decision=holder.report)  # given to the engine at build time
    assert holder.checkpoint_files(1) == [(NAME, None)]  # before the decision: nothing to save (a stale file goes)
    engine.on_auto_decision(AutoDecision(dec := decision(), rebuild=False))
    assert holder.checkpoint_files(2)[0][1]["decided_at"] == 2
    holder.reported = None  # the trainer took it
    (name, record), = holder.checkpoint_files(6)
    assert record == {"format": FORMAT, "iteration": 6, "decided_at": 2, "key": {"pp": 2}, "decision": dec}
    write_step_file(str(tmp_path), name, record)
    assert read_record(str(tmp_path)) == json.loads(json.dumps(record))


def test_the_auto_plan_weighs_the_head_by_flops():
    from megatron_ds.pipe.plan.partition import layer_flops
    for vocab in (1024, 256000):
        sizes = SimpleNamespace(**{**vars(SIZES), "vocab_size": vocab})
        flops = layer_flops(sizes)
        assert make_plan(sizes, ds(), PP, 1)[1].head_layers == flops[-1] / flops[1] > 0
