"""PipelinePlan: the run's schedule, placement, shapes and segments, computed once, without torch."""
import dataclasses
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_ds.pipe.plan.config import ConfigError
from megatron_ds.pipe.plan.plan import PipelinePlan
from megatron_ds.schedules import build_schedule

ROOT = Path(__file__).resolve().parents[3]
MODEL = SimpleNamespace(num_layers=8, hidden_size=32, ffn_hidden_size=128, max_position_embeddings=64)


def plan_for(pipeline, gas=8, mbs=2, zero=1, pp=4, dp=1, seq=None, tp=1, sp=False):
    ds_config = {"train_micro_batch_size_per_gpu": mbs, "gradient_accumulation_steps": gas,
                 "zero_optimization": {"stage": zero}, "pipeline": pipeline}
    model = SimpleNamespace(**vars(MODEL), tensor_model_parallel_size=tp, sequence_parallel=sp)
    return PipelinePlan.from_config(model, ds_config, pp, dp, seq)


def test_one_plan_serves_module_and_engine():
    plan = plan_for({"schedule": "zbv"})
    assert plan.placement == [[0, 1, 2, 3, 3, 2, 1, 0]]
    assert plan.activation_shape == (2, 64, 32) and plan.micro_batches == 8
    assert plan.for_micro_batches(8) is plan.schedule  # built once, then cached
    assert plan.for_micro_batches(4).micro_batches == 4
    assert plan.needs_data(0) and not plan.needs_data(1)  # rank 0 holds stage 0 and the loss stage


def test_the_plan_is_frozen_and_a_switch_is_a_new_plan():
    plan = plan_for({"schedule": "zb-h1"})
    for name, value in (("settings", None), ("micro_batches", 4), ("segment_lengths", (32, 32)), ("make", None)):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(plan, name, value)
    ops = plan.program(0, 8, True).ops
    switched = plan.switch({"schedule": "zb-h2"})
    assert switched is not plan and switched.placement == plan.placement
    assert (plan.settings.schedule, plan.schedule.name) == ("zb-h1", "zb-h1")  # the old plan runs as it did
    assert plan.program(0, 8, True).ops == ops and switched.program(0, 8, True).ops != ops
    assert switched.schedule.name == "zb-h2" and switched.micro_batches == plan.micro_batches
    with pytest.raises(ValueError, match="places chunks"):
        plan.switch({"schedule": "zbv"})


def test_eval_program_runs_the_forwards_only():
    plan = plan_for({"schedule": "zb-h1"})
    train, evaluate = plan.program(1, 8, True), plan.program(1, 8, False)
    assert plan.program(1, 8, True) is train
    assert {op.kind for op in train.ops} == {"F", "B", "W"}
    assert [op for op in train.ops if op.kind == "F"] == evaluate.ops
    assert all(key[0] == "act" for keys in evaluate.messages.sends.values() for key in keys)


def test_seq1f1b_segments_cut_tokens_and_messages():
    plan = plan_for({"schedule": "seq1f1b", "seq_splits": 2, "seq_split_method": "even"})
    assert plan.segment_lengths == (32, 32)
    assert plan.segment(1) == slice(32, 64)
    assert plan.message_shape(("act", 0, 0, 0, 1)) == (2, 32, 32)
    whole = plan_for({"schedule": "1f1b"})
    assert whole.segment(0) == slice(None) and whole.message_shape(("act", 0, 0, 0, 0)) == (2, 64, 32)


def test_sequence_parallel_messages_carry_the_tensor_rank_shard():
    assert plan_for({"schedule": "zbv"}, tp=4).message_shape(("act", 0, 0, 0, 0)) == (2, 64, 32)  # TP alone
    assert plan_for({"schedule": "zbv"}, tp=4, sp=True).message_shape(("grad", 0, 3, 0, 0)) == (2, 16, 32)
    seq = plan_for({"schedule": "seq1f1b", "seq_splits": 3}, tp=2, sp=True)
    assert seq.segment_lengths == (16, 16, 32)  # balanced: each segment is split over the TP ranks on its own
    assert [seq.message_shape(("act", 0, 0, 0, i)) for i in range(3)] == [(2, 8, 32), (2, 8, 32), (2, 16, 32)]


@pytest.mark.parametrize("kwargs, words", [
    (dict(pipeline={"schedule": "1f1b"}, seq=30, tp=4, sp=True),
     ["--sequence-parallel", "--seq-length 30", "multiple of --tensor-model-parallel-size 4"]),
    (dict(pipeline={"schedule": "seq1f1b", "seq_splits": 4, "seq_split_method": "even"}, seq=24, tp=4, sp=True),
     ["Seq1F1B segment", "[6, 6, 6, 6]", "multiples of --tensor-model-parallel-size 4"]),
    (dict(pipeline={"schedule": "zbv"}, zero=0), ["ZeRO stage 1", "is 0"]),
    (dict(pipeline={"schedule": "interleaved", "virtual_stages": 2}, gas=9),
     ["interleaved", "micro_batches=9", "equal rounds"]),
    (dict(pipeline={"schedule": "interleaved", "virtual_stages": 3}),
     ["--num-layers 8 < 12 virtual stages", "one virtual stage per rank", "pipeline size of at most 2"]),
    (dict(pipeline={"schedule": "seq1f1b", "seq_splits": 3, "seq_split_method": "even"}),
     ["seq_splits", "--seq-length 64", "multiple"]),
])
def test_impossible_plans_name_the_setting(kwargs, words):
    with pytest.raises(ConfigError) as err:
        plan_for(**kwargs)
    for word in words:
        assert word in str(err.value), (word, str(err.value))


def test_planning_imports_no_torch():
    code = ("import sys; from types import SimpleNamespace as N; from megatron_ds.pipe.plan.plan import PipelinePlan; "
            "m = N(num_layers=4, hidden_size=8, ffn_hidden_size=32, max_position_embeddings=16); "
            "PipelinePlan.from_config(m, {'train_batch_size': 8, 'train_micro_batch_size_per_gpu': 1, "
            "'zero_optimization': {'stage': 1}, 'pipeline': {'schedule': 'zbv'}}, 2, 1).program(0, 8, True); "
            "print('torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.stdout.strip() == "False", proc.stderr


def test_vocab_parallel_plan_loads_data_everywhere_and_refuses_what_it_cannot_run(tmp_path):
    plan = plan_for({"schedule": "1f1b", "vocab_parallel": True})
    assert all(plan.needs_data(r) for r in range(4))  # EF reads the tokens, S the labels, on every rank
    assert [plan.message_shape((what, 0, 1, 0, 0)) for what in ("emb", "stat", "share")] == [
        (2, 64, 32), (2, 64, 3), (2, 64, 64)]
    # under SP (TP=2) the messages carry this TP rank's shard of the tokens, but for the block's statistics
    sp = plan_for({"schedule": "1f1b", "vocab_parallel": True}, tp=2, sp=True)
    assert [sp.message_shape((what, 0, 1, 0, 0)) for what in ("emb", "hid", "stat", "share", "egrad")] == [
        (2, 32, 32), (2, 32, 32), (2, 64, 3), (2, 32, 64), (2, 32, 32)]
    with pytest.raises(ConfigError, match=r"vocabulary of 36 rows does not split over the 4 pipeline x 2 tensor-"
                                          r"parallel ranks; pad it to a multiple of 8"):
        PipelinePlan.from_config(SimpleNamespace(**vars(MODEL), vocab_size=36, tensor_model_parallel_size=2),
                                 {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 8,
                                  "zero_optimization": {"stage": 1},
                                  "pipeline": {"schedule": "1f1b", "vocab_parallel": True}}, 4, 1)
    for section in ({"partition_method": "flops"}, {"post_validation": True}):  # these combine with it
        assert plan_for({"schedule": "1f1b", "vocab_parallel": True, **section}).settings.vocab_parallel
    liger = SimpleNamespace(**vars(MODEL), liger_kernel=True)
    with pytest.raises(ConfigError, match="vocab_parallel.*--use-liger-kernel: Liger's fused kernel computes the loss "
                                          "over the whole vocabulary.*--loss-chunk-size N"):
        PipelinePlan.from_config(liger, {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 8,
                                         "zero_optimization": {"stage": 1},
                                         "pipeline": {"schedule": "1f1b", "vocab_parallel": True}}, 4, 1)
    path = tmp_path / "v.json"  # a file carrying vocabulary passes, run without the key
    path.write_text(build_schedule("1f1b", 4, 8, vocab_parallel=True).to_json())
    with pytest.raises(ConfigError, match="the file places vocabulary passes"):
        plan_for({"schedule": f"file:{path}"})
    assert plan_for({"schedule": f"file:{path}", "vocab_parallel": True}).schedule.vocab_parallel
    plain = tmp_path / "plain.json"  # the key asks for passes the file does not place
    plain.write_text(build_schedule("1f1b", 4, 8).to_json())
    with pytest.raises(ConfigError, match="the file has no vocabulary passes .* export it with them"):
        plan_for({"schedule": f"file:{plain}", "vocab_parallel": True})


def test_the_engine_installs_only_a_plan_placed_as_its_module():
    """ScheduleEngine.use_plan: "auto"'s probe and its choice swap in when they place the chunks alike; another
    placement would run a schedule over chunks the module does not hold, so it is refused."""
    from megatron_ds.pipe.engine import ScheduleEngine
    engine = SimpleNamespace(plan=plan_for({"schedule": "zb-h1"}))
    h2 = engine.plan.switch({"schedule": "zb-h2"})
    ScheduleEngine.use_plan(engine, h2)
    assert engine.plan is h2
    zbv = plan_for({"schedule": "zbv"})
    with pytest.raises(RuntimeError, match=r"rebuild the module"):
        ScheduleEngine.use_plan(engine, zbv)
    assert engine.plan is h2
