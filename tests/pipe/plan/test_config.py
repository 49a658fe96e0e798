"""The ds_config "pipeline" section: every wrong key or impossible setting is one clear error."""
import pytest

from megatron_ds.pipe.plan.config import ConfigError, pipeline_settings
from megatron_ds.schedules import build_schedule
from megatron_ds.testing.launcher import run_ranks


def test_defaults_mean_the_stock_engine():
    s = pipeline_settings({})
    assert s.stock and s.schedule == "deepspeed" and s.partition_method == "type:transformer"


def test_schedule_keys_are_read():
    s = pipeline_settings({"pipeline": {"schedule": "interleaved", "virtual_stages": 2, "activation_checkpoint_interval": 1}})
    assert (s.schedule, s.virtual_stages, s.stock) == ("interleaved", 2, False)


def test_cuda_graphs_ride_on_the_compiled_layers():
    s = pipeline_settings({"pipeline": {"schedule": "seq1f1b", "seq_splits": 2, "compile_layers": True,
                                        "cuda_graphs": True}})
    assert (s.compile_layers, s.cuda_graphs) == (True, True)
    assert pipeline_settings({}).cuda_graphs is False
    # by default the layers compile on CUDA where each is one graph; the key decides where given
    default = pipeline_settings({})
    assert [default.compiles_layers(cuda, splits) for cuda in (False, True) for splits in (False, True)] == \
        [False, False, True, False]
    for value in (False, True):
        given = pipeline_settings({"pipeline": {"schedule": "1f1b", "compile_layers": value}})
        assert {given.compiles_layers(cuda, splits) for cuda in (False, True) for splits in (False, True)} == {value}


def test_op_costs_build_the_v_order_for_them():
    s = pipeline_settings({"pipeline": {"schedule": "zbv-half", "op_costs": [3.08, 4.37, 2.04]}})
    assert s.build_schedule(4, 16).ranks == build_schedule("zbv-half", 4, 16, op_costs=(3.08, 4.37, 2.04)).ranks
    assert s.build_schedule(4, 16).ranks != build_schedule("zbv-half", 4, 16).ranks


@pytest.mark.parametrize("section,words", [
    ({"schedule": "zb-h3"}, ["pipeline.schedule", "zb-h3", "zbv"]),
    ({"schedule": "1f1b", "virtual_stage": 2}, ["unknown key", "virtual_stage"]),
    ({"schedule": "interleaved", "virtual_stages": 0}, ["pipeline.virtual_stages", ">= 1"]),
    ({"schedule": "zbv", "virtual_stages": 2}, ["virtual_stages", "interleaved"]),
    ({"schedule": "1f1b", "seq_splits": 4}, ["seq_splits", "seq1f1b"]),
    ({"schedule": "seq1f1b", "seq_split_method": "random"}, ["seq_split_method", "random"]),
    ({"schedule": "zbv", "post_validation": "yes"}, ["post_validation", "true or false"]),
    ({"schedule": "zbv", "partition_method": "by-magic"}, ["partition_method", "by-magic"]),
    ({"post_validation": True}, ["post_validation", "named", "schedule"]),
    ({"schedule": "zbv", "op_costs": [1, 1.5, 0.5]}, ["pipeline.op_costs", "zbv does not take", "zbv-half, zbv-min"]),
    ({"schedule": "zbv-half", "op_costs": [1, 1.5]}, ["pipeline.op_costs", "[TF, TB, TW]", "bench.layer_costs"]),
    ({"schedule": "zbv-min", "op_costs": [1, 0, 1]}, ["pipeline.op_costs", "positive"]),
    ({"op_costs": [1, 1.5, 0.5]}, ["op_costs", "named", "schedule"]),
    ({"schedule": "auto", "memory_budget": 3, "op_costs": [1, 1.5, 0.5]}, ["op_costs", "auto", "itself"]),
    ({"schedule": "1f1b", "vocab_parallel": "yes"}, ["pipeline.vocab_parallel", "true or false"]),
    ({"schedule": "1f1b", "cuda_graphs": True, "compile_layers": False}, ["pipeline.cuda_graphs", "compile_layers"]),
    ({"cuda_graphs": True, "compile_layers": True}, ["pipeline.cuda_graphs", "DeepSpeed's own engine", "schedule"]),
    ({"cuda_graphs": 1, "compile_layers": True}, ["pipeline.cuda_graphs", "true or false"]),
    ({"vocab_parallel": True}, ["pipeline.vocab_parallel", "named", "deepspeed"]),
])
def test_bad_settings_name_key_value_and_rule(section, words):
    with pytest.raises(ConfigError) as err:
        pipeline_settings({"pipeline": section})
    for word in words:
        assert word in str(err.value), (word, str(err.value))


def _build_error(pipeline, num_layers, gas, zero=1):
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    from megatron_ds.pipe.build import build_pipeline_module
    from tests.gpt_harness import ds_config, tiny_config
    try:
        build_pipeline_module(tiny_config(num_layers), ds_config(1, 1, gas, pipeline=pipeline, zero=zero), 1)
    except ConfigError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("pipeline,layers,gas,words", [
    ({"schedule": "bitpipe"}, 4, 4, ["bitpipe", "even"]),
    ({"schedule": "zbv"}, 3, 4, ["--num-layers 3", "multiple of 2"]),
    ({"schedule": "interleaved", "virtual_stages": 4}, 2, 4, ["--num-layers 2", "one virtual stage per rank"]),
    ({"schedule": "zbv", "zero": 0}, 4, 4, ["ZeRO stage 1", "is 0"]),
])
def test_impossible_schedule_settings_are_refused_at_build(pipeline, layers, gas, words):
    pipeline = dict(pipeline)
    zero = pipeline.pop("zero", 1)
    message = run_ranks(1, _build_error, pipeline, layers, gas, zero)[0]
    assert message is not None, f"{pipeline} with {layers} layers was accepted"
    for word in words:
        assert word in message, (word, message)


def test_sequence_parallel_sends_stock_activations_whole():
    from megatron_ds.pipe.plan.config import sequence_parallel_ds_config
    cfg = {"train_batch_size": 8, "pipeline": {"partition": "uniform"}}
    assert sequence_parallel_ds_config(cfg) == {"train_batch_size": 8, "pipeline": {
        "partition": "uniform", "pipe_partitioned": False, "grad_partitioned": False}}
    assert cfg["pipeline"] == {"partition": "uniform"}  # a copy, not an edit
    with pytest.raises(ConfigError, match='"pipeline" grad_partitioned = true with --sequence-parallel'):
        sequence_parallel_ds_config({"pipeline": {"grad_partitioned": True}})


def test_every_pipeline_key_is_documented_in_training_and_design():
    """The ds_config "pipeline" keys of PipelineSettings each have a row in docs/TRAINING.md's and docs/DESIGN.md's
    key tables (a row may name several keys)."""
    import pathlib
    import re

    from megatron_ds.pipe.plan.config import PipelineSettings
    root = pathlib.Path(__file__).resolve().parents[3]
    for doc in ("docs/TRAINING.md", "docs/DESIGN.md"):
        rows = [line.split("|")[1] for line in (root / doc).read_text().splitlines() if line.startswith("| `")]
        documented = {key for cell in rows for key in re.findall(r"`(\w+)`", cell)}
        missing = sorted(set(PipelineSettings.__dataclass_fields__) - documented)
        assert not missing, f"{doc} has no row for pipeline key(s) {missing}"
