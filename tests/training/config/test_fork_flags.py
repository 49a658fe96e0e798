"""The forks' flags land in the ds_config "pipeline" section; clashes and unknown flags give one line each;
schedule-shape errors come at parse time."""
import json
import os
import subprocess
import sys

import pytest

from megatron_ds.schedules.catalog import CATALOG
from megatron_ds.testing.launcher import child_env
from megatron_ds.training.config.arguments import ArgumentsError, parse_args
from tests.training.config.parsing import parse_with

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
# 8 layers, pipeline 2 x data 2, micro-batch 1, 4 micro-batches per step
BASE = ["--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "64",
        "--lr", "1e-3", "--train-iters", "10", "--data-path", "corpus", "--vocab-file", __file__,
        "--merge-file", __file__, "--micro-batch-size", "1", "--global-batch-size", "8",
        "--pipeline-model-parallel-size", "2"]


pytestmark = pytest.mark.usefixtures("empty_corpus")  # tests/training/conftest.py


def parse(*extra, ds=None, base=BASE):
    return parse_with(base, *extra, world=4, ds=ds)


def pipeline(*extra, ds=None):
    return parse(*extra, ds=ds).ds_config.get("pipeline", {})


@pytest.mark.parametrize("flags, keys", [
    (["--enable-zero-bubble"], {"schedule": "zb-h1"}),
    (["--enable-zero-bubble", "--zero-bubble-max-pending-backward", "2"], {"schedule": "zb-h1"}),
    (["--enable-zero-bubble", "--zero-bubble-max-pending-backward", "4"], {"schedule": "zb-h2"}),
    (["--zero-bubble-v-schedule"], {"schedule": "zbv"}),
    (["--enable-zero-bubble", "--zero-bubble-v-schedule"], {"schedule": "zbv"}),
    (["--enable-zbh1-pipeline"], {"schedule": "zb-h1"}),
    (["--enable-zbh1-pipeline", "--enable-optimizer-post-validation"], {"schedule": "zb-h1", "post_validation": True}),
    (["--enable-bitpipe-schedule"], {"schedule": "bitpipe"}),
    (["--enable-zbh1-pipeline", "--compile-layers", "--enable-cuda-graph"],
     {"schedule": "zb-h1", "compile_layers": True, "cuda_graphs": True}),
    (["--num-layers-per-virtual-pipeline-stage", "2"], {"schedule": "interleaved", "virtual_stages": 2}),
    (["--num-layers-per-virtual-pipeline-stage", "1"], {"schedule": "interleaved", "virtual_stages": 4}),
    (["--zero-bubble-v-schedule", "--num-layers-per-virtual-pipeline-stage", "2"], {"schedule": "zbv"}),
    (["--pipe-sp-splits", "4"], {"schedule": "seq1f1b", "seq_splits": 4}),
    (["--pipe-sp-splits", "4", "--pipe-sp-strategy", "uniform_comp"],
     {"schedule": "seq1f1b", "seq_splits": 4, "seq_split_method": "balanced"}),
    (["--pipe-sp-splits", "4", "--pipe-sp-strategy", "average"],
     {"schedule": "seq1f1b", "seq_splits": 4, "seq_split_method": "even"}),
    (["--pipe-sp-splits", "2", "--num-layers-per-virtual-pipeline-stage", "2"],
     {"schedule": "seq1f1b", "seq_splits": 2, "virtual_stages": 2}),
    (["--pipe-sp-splits", "1"], {}),
])
def test_fork_flag_sets_pipeline_keys(flags, keys):
    args = parse(*flags)
    assert args.ds_config.get("pipeline", {}) == keys
    settings = args.pipeline_settings  # the engine reads these
    assert settings.schedule == keys.get("schedule", "deepspeed")
    assert settings.post_validation == keys.get("post_validation", False)
    assert (settings.virtual_stages, settings.seq_splits) == (keys.get("virtual_stages", 1), keys.get("seq_splits", 1))


def test_flag_agreeing_with_ds_config_and_filling_it():
    ds = {"pipeline": {"schedule": "zbv", "trace_dir": "t"}}
    assert pipeline("--zero-bubble-v-schedule", "--enable-optimizer-post-validation", ds=ds) == \
        {"schedule": "zbv", "trace_dir": "t", "post_validation": True}
    assert pipeline("--pipe-sp-strategy", "uniform_comp", ds={"pipeline": {"schedule": "seq1f1b", "seq_splits": 2}}) \
        == {"schedule": "seq1f1b", "seq_splits": 2, "seq_split_method": "balanced"}


@pytest.mark.parametrize("flags, ds, message", [
    (["--zero-bubble-v-schedule"], {"pipeline": {"schedule": "1f1b"}},
     '--zero-bubble-v-schedule ("pipeline.schedule" = "zbv") disagrees with ds_config "pipeline.schedule" = "1f1b" '
     "in ds.json; give one of them, or make them equal"),
    (["--enable-optimizer-post-validation"], {"pipeline": {"schedule": "zb-h1", "post_validation": False}},
     '--enable-optimizer-post-validation ("pipeline.post_validation" = true) disagrees with ds_config '
     '"pipeline.post_validation" = false in ds.json; give one of them, or make them equal'),
    (["--pipe-sp-splits", "4"], {"pipeline": {"schedule": "seq1f1b", "seq_splits": 2}},
     '--pipe-sp-splits 4 ("pipeline.seq_splits" = 4) disagrees with ds_config "pipeline.seq_splits" = 2 in ds.json; '
     "give one of them, or make them equal"),
    (["--enable-zero-bubble", "--zero-bubble-max-pending-backward", "4"], {"pipeline": {"schedule": "zb-h1"}},
     '--enable-zero-bubble ("pipeline.schedule" = "zb-h2") disagrees with ds_config "pipeline.schedule" = "zb-h1" '
     "in ds.json; give one of them, or make them equal"),
    (["--enable-bitpipe-schedule", "--zero-bubble-v-schedule"], None,
     "--zero-bubble-v-schedule (zbv) and --enable-bitpipe-schedule (bitpipe) ask for different schedules: give one"),
    (["--enable-zero-bubble", "--zero-bubble-max-pending-backward", "3"], None,
     "--zero-bubble-max-pending-backward 3: give p = 2 (zb-h1) or 2p = 4 (zb-h2) for "
     "--pipeline-model-parallel-size 2; other memory limits are not offered"),
    (["--num-layers-per-virtual-pipeline-stage", "3"], None,
     "--num-layers-per-virtual-pipeline-stage 3: --num-layers 8 must be a multiple of N x "
     "--pipeline-model-parallel-size 2 = 6"),
    (["--num-layers-per-virtual-pipeline-stage", "1"], {"pipeline": {"schedule": "zb-h1"}},
     "--num-layers-per-virtual-pipeline-stage 1 gives 4 virtual stages per rank, which schedule 'zb-h1' does "
     "not take (only interleaved and seq1f1b do)"),
    (["--kill-switch-file", "a", "--kill-switch-path", "b"], None,
     "--kill-switch-file a disagrees with --kill-switch-path b: give one"),
])
def test_conflict_is_one_message_naming_both(flags, ds, message):
    with pytest.raises(ArgumentsError) as info:
        parse(*flags, ds=ds)
    assert str(info.value) == message


@pytest.mark.parametrize("schedule", [name for name, spec in CATALOG.items() if isinstance(spec.virtual_stages, int)])
def test_virtual_stage_flag_follows_the_catalogue(schedule):
    """Every schedule the catalogue gives two chunks per rank takes Megatron's flag for 2 and refuses 4."""
    ds = {"zero_optimization": {"stage": 1}, "pipeline": {"schedule": schedule}}
    assert pipeline("--num-layers-per-virtual-pipeline-stage", "2", ds=ds) == {"schedule": schedule}
    with pytest.raises(ArgumentsError, match=f"gives 4 virtual stages per rank, but schedule '{schedule}' always uses"):
        parse("--num-layers-per-virtual-pipeline-stage", "1", ds=ds)


def test_megatron_lm_and_ds_aliases(capsys):
    args = parse("--deepspeed-activation-checkpointing", "--checkpoint-activations")
    assert args.activation_checkpoint_interval == 1
    assert parse("--kill-switch-file", "stop").kill_switch_path == "stop"
    capsys.readouterr()
    args = parse("--use-flash-attn")
    out = capsys.readouterr().out
    assert out.count("--use-flash-attn") == 1 and "scaled_dot_product_attention" in out
    assert parse("--use-flash-attn-v2").use_flash_attn


def recompute_of(args):
    c = args.gpt_config
    return c.recompute_granularity, c.recompute_method, c.recompute_num_layers, args.activation_checkpoint_interval


def test_megatron_recompute_flags_keep_megatron_meaning():
    """Megatron-LM: --recompute-activations is selective; full recomputes layers by uniform (default, N = 1) or
    block; the settings reach the model (GPTConfig) for every engine, and DeepSpeed's interval stays positive."""
    assert recompute_of(parse("--recompute-activations")) == ("selective", None, None, 0)
    assert recompute_of(parse("--recompute-granularity", "selective", "--enable-zbh1-pipeline")) == \
        ("selective", None, None, 0)
    assert recompute_of(parse("--recompute-granularity", "full")) == ("full", None, None, 1)
    zbv = ("--zero-bubble-v-schedule",)
    assert recompute_of(parse(*zbv, "--recompute-granularity", "full", "--recompute-method", "uniform",
                              "--recompute-num-layers", "2")) == ("full", "uniform", 2, 2)
    assert recompute_of(parse(*zbv, "--recompute-granularity", "full", "--recompute-method", "block",
                              "--recompute-num-layers", "1")) == ("full", "block", 1, 1)
    assert recompute_of(parse("--checkpoint-activations")) == (None, None, None, 1)  # DeepSpeed's own interval


@pytest.mark.parametrize("flags, message", [
    (["--recompute-method", "block"], "--recompute-method and --recompute-num-layers choose the layers a full "
     "recompute checkpoints: they need --recompute-granularity full"),
    (["--recompute-activations", "--recompute-num-layers", "2"], "need --recompute-granularity full"),
    (["--recompute-granularity", "full", "--recompute-activations"],
     "--recompute-activations (selective, as in Megatron-LM) disagrees with --recompute-granularity full: give one"),
    (["--recompute-granularity", "selective", "--checkpoint-activations"], "--checkpoint-activations recomputes "
     "whole layers, --recompute-granularity selective the attention core only: give one"),
    (["--recompute-granularity", "full", "--recompute-num-layers", "0"], "--recompute-num-layers must be positive"),
    (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1"],
     "--recompute-method block with DeepSpeed's own engine (no \"pipeline.schedule\")"),
    (["--recompute-granularity", "full", "--recompute-num-layers", "2"],
     "--recompute-method uniform with --recompute-num-layers 2 with DeepSpeed's own engine"),
    (["--recompute-granularity", "selective", "--enable-zbh1-pipeline", "--compile-layers", "--enable-cuda-graph"],
     "--recompute-granularity selective with CUDA graphs (--enable-cuda-graph)"),
])
def test_recompute_refusals_are_one_line(flags, message):
    with pytest.raises(ArgumentsError) as info:
        parse(*flags)
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("flags, message", [
    (["--zero-bubble-v-schedule", "--num-layers", "6"],
     "schedule 'zbv' cuts the model into 4 virtual stages: --num-layers 6 must be a multiple of 4"),
    (["--enable-bitpipe-schedule", "--num-layers", "6"],
     "schedule 'bitpipe' cuts the model into 4 virtual stages: --num-layers 6 must be a multiple of 4"),
    (["--num-layers-per-virtual-pipeline-stage", "2", "--global-batch-size", "14"],
     "interleaved with virtual_stages=2 needs"),
    (["--pipe-sp-splits", "16", "--pipe-sp-strategy", "uniform_comp"],
     'ds_config "pipeline.seq_splits" = 16 with "seq_split_method": "balanced": seq_length=64 is too short'),
    (["--pipe-sp-splits", "3", "--pipe-sp-strategy", "even"], "--seq-length 64 must be a multiple of seq_splits"),
    (["--zero-bubble-v-schedule", "--zero-stage", "0"], "runs with ZeRO stage 1"),
])
def test_schedule_shape_checked_at_parse_time(flags, message):
    with pytest.raises(ArgumentsError, match=None) as info:
        parse(*flags)
    assert message in str(info.value)


def test_allow_padding_num_layers():
    with pytest.raises(ArgumentsError) as info:
        parse("--zero-bubble-v-schedule", "--num-layers", "6")
    assert "--allow-padding-num-layers" in str(info.value)
    assert pipeline("--zero-bubble-v-schedule", "--num-layers", "6", "--allow-padding-num-layers") == {
        "schedule": "zbv", "allow_padding_num_layers": True}
    with pytest.raises(ArgumentsError, match="disagrees with"):
        parse("--allow-padding-num-layers", ds={"pipeline": {"schedule": "zbv", "allow_padding_num_layers": False}})


def test_enable_vocab_parallel_sets_the_key_and_refuses_what_the_engine_does_not_run():
    section = pipeline("--enable-zbh1-pipeline", "--enable-vocab-parallel")
    assert section == {"schedule": "zb-h1", "vocab_parallel": True}
    args = parse("--enable-zbh1-pipeline", "--enable-vocab-parallel", "--save", "ckpt", "--load", "ckpt")
    assert (args.save, args.load) == ("ckpt", "ckpt")  # saved and loaded as any layout (pipe/vocab/vocab_checkpoint.py)
    with pytest.raises(ArgumentsError, match="--universal-checkpoint: ckpt holds no universal checkpoint"):
        parse("--enable-zbh1-pipeline", "--enable-vocab-parallel", "--load", "ckpt", "--universal-checkpoint")
    args = parse("--enable-zbh1-pipeline", "--enable-vocab-parallel", "--tensor-model-parallel-size", "2",
                 "--save", "c", "--load", "c")
    assert (args.save, args.load) == ("c", "c")  # and at TP > 1: each TP file holds its rows, as without VP
    assert parse("--enable-zbh1-pipeline", "--enable-vocab-parallel", "--loss-chunk-size", "16").loss_chunk_size == 16


def test_cost_partition_checked_at_parse_time():
    """An impossible cost partition stops the parse, for our engine and DeepSpeed's own."""
    for schedule in ("zbv", "deepspeed"):
        with pytest.raises(ArgumentsError, match=r"3 costs for 11 pipeline layers"):
            parse(ds={"pipeline": {"schedule": schedule, "partition_method": "costs:[1, 2, 3]"}})
    section = pipeline(ds={"pipeline": {"schedule": "zbv", "partition_method": "flops"}})
    assert section["partition_method"] == "flops"


def test_bitpipe_needs_even_pipeline_and_takes_any_micro_batch_count():
    """BitPipe's rule (docs/SCHEDULES.md): p even; any m, the last unit of p micro-batches partial."""
    with pytest.raises(ArgumentsError, match="bitpipe needs an even pipeline size"):
        parse_args(BASE[:-1] + ["3", "--enable-bitpipe-schedule", "--global-batch-size", "3",
                                "--num-layers", "6"], env={"WORLD_SIZE": "3", "RANK": "0"})
    for m in (1, 5, 6, 8):  # p = 4
        args = parse_args(BASE[:-1] + ["4", "--enable-bitpipe-schedule", "--global-batch-size", str(m)],
                          env={"WORLD_SIZE": "4", "RANK": "0"})
        assert (args.gradient_accumulation_steps, args.pipeline_settings.schedule) == (m, "bitpipe")


# Runs pretrain_gpt.py as __main__ and reports which heavy packages were imported before it exited.
_CLI = """import runpy, sys
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    print(sorted({m.split(".")[0] for m in sys.modules} & {"torch", "deepspeed", "numpy"}), file=sys.stderr)
"""


def _cli(*extra):
    proc = subprocess.run([sys.executable, "-c", _CLI, os.path.join(ROOT, "pretrain_gpt.py"), *BASE, *extra],
                          capture_output=True, text=True, timeout=600,
                          env=child_env(ROOT, WORLD_SIZE="4", RANK="0"))
    *lines, imported = proc.stderr.strip().splitlines()
    return proc.returncode, lines, imported


def test_cli_unknown_flags_and_shape_error_are_one_line_exit_2_before_torch():
    rc, lines, _ = _cli("--zero-bubble-v-schedul", "--num-seq-splits", "4",
                        "--zero-bubble-adaptive-memory-limit-percentile")
    assert rc == 2
    assert lines == [
        "pretrain_gpt.py: error: unrecognized argument --zero-bubble-v-schedul: did you mean --zero-bubble-v-schedule?",
        'pretrain_gpt.py: error: unrecognized argument --num-seq-splits: --pipe-sp-splits K (ds_config "pipeline": '
        '{"schedule": "seq1f1b", "seq_splits": K})',
        "pretrain_gpt.py: error: unrecognized argument --zero-bubble-adaptive-memory-limit-percentile: not offered: "
        "use --zero-bubble-max-pending-backward p (zb-h1) or 2p (zb-h2)"]
    rc, lines, imported = _cli("--zero-bubble-v-schedule", "--num-layers", "6")
    assert rc == 2 and len(lines) == 1 and "--num-layers 6 must be a multiple of 4" in lines[0], lines
    assert "--allow-padding-num-layers" in lines[0]
    assert imported == "[]", f"a schedule-shape error came after importing {imported}"  # fast: before torch


@pytest.mark.parametrize("flags, ds, method", [
    (["--pipeline-model-parallel-layout", "Et*5|t*3L"], {"pipeline": {"schedule": "1f1b"}}, "layout:Et*5|t*3L"),
    (["--pipeline-model-parallel-layout", "Et|t*3|t*3|tL"], {"zero_optimization": {"stage": 1},
                                                         "pipeline": {"schedule": "zbv"}}, "layout:Et|t*3|t*3|tL"),
    (["--decoder-first-pipeline-num-layers", "3"], None, "layout:Ettt|tttttL"),
    (["--decoder-last-pipeline-num-layers", "2", "--decoder-first-pipeline-num-layers", "6"],
     {"pipeline": {"schedule": "1f1b"}}, "layout:Etttttt|ttL"),
])
def test_megatron_core_layout_flags(flags, ds, method):
    """--pipeline-model-parallel-layout and the first/last-stage counts write "pipeline.partition_method"."""
    assert pipeline(*flags, ds=ds)["partition_method"] == method


@pytest.mark.parametrize("flags, ds, words", [
    (["--pipeline-model-parallel-layout", "Et*5|t*3L"], {"zero_optimization": {"stage": 1},
                                                     "pipeline": {"schedule": "zbv"}},
     "layout 'Et*5|t*3L' has 2 stages; the schedule cuts the model into 4 virtual stages"),
    (["--pipeline-model-parallel-layout", "Et*4|t*3L"], None, "places 7 transformer layers; the model has 8"),
    (["--pipeline-model-parallel-layout", "Et*5|m|t*3L"], None, "'m' (Megatron's multi-token-prediction layer)"),
    (["--decoder-first-pipeline-num-layers", "2"], {"zero_optimization": {"stage": 1},
                                                    "pipeline": {"schedule": "zbv"}},
     "schedule 'zbv' places 2 virtual stages on each rank; write each stage's layers with "
     "--pipeline-model-parallel-layout"),
    (["--decoder-first-pipeline-num-layers", "9"], None, "leave -1 of --num-layers 8 to the 1 other stages"),
    (["--pipeline-model-parallel-layout", "Et*5|t*3L", "--decoder-first-pipeline-num-layers", "5"], None,
     "both cut the layers: give one"),
    (["--pipeline-model-parallel-layout", "Et*5|t*3L"], {"pipeline": {"partition_method": "flops"}},
     '"pipeline.partition_method" = "layout:Et*5|t*3L") disagrees with ds_config "pipeline.partition_method"'),
])
def test_a_layout_that_cannot_cut_stops_the_parse(flags, ds, words):
    with pytest.raises(ArgumentsError) as info:
        parse(*flags, ds=ds)
    assert words in str(info.value) and "\n" not in str(info.value)


SHIPPED = sorted(os.path.join(ROOT, "ds_configs", name) for name in os.listdir(os.path.join(ROOT, "ds_configs")))


@pytest.mark.parametrize("path", SHIPPED, ids=os.path.basename)
def test_the_layout_flag_works_with_every_shipped_config(path):
    """The shipped configs leave "partition_method" at its default, so --pipeline-model-parallel-layout cuts
    the model under each of them (a written-out "type:transformer" would clash with the flag)."""
    with open(path) as fh:
        ds = json.load(fh)
    if ds.get("pipeline", {}).get("schedule") == "auto":
        pytest.skip('"auto" chooses the schedule, so no one layout fits every choice')
    try:
        pipeline("--pipeline-model-parallel-layout", "Et*5|t*3L", ds=ds)
        layout = "Et*5|t*3L"
    except ArgumentsError as exc:  # two virtual stages per rank
        assert "the schedule cuts the model into 4 virtual stages" in str(exc), exc
        layout = "Et*2|t*2|t*2|t*2L"
    assert pipeline("--pipeline-model-parallel-layout", layout, ds=ds)["partition_method"] == "layout:" + layout


def test_a_config_written_with_the_default_method_is_told_to_drop_it():
    with pytest.raises(ArgumentsError) as info:
        parse("--pipeline-model-parallel-layout", "Et*5|t*3L",
              ds={"pipeline": {"schedule": "1f1b", "partition_method": "type:transformer"}})
    assert 'drop the key from ds.json ("type:transformer" is the default)' in str(info.value)


def test_megatron_cores_overlap_flag_is_the_overlap_key():
    """--overlap-moe-expert-parallel-comm writes "pipeline.overlap", merged as the other pipeline flags."""
    flag = "--overlap-moe-expert-parallel-comm"
    section = parse(flag, ds={"pipeline": {"schedule": "1f1b"}}).pipeline_settings
    assert section.overlap and section.schedule == "1f1b"
    assert pipeline(flag, ds={"pipeline": {"schedule": "dualpipev", "overlap": True}})["overlap"] is True
    assert not parse(ds={"pipeline": {"schedule": "1f1b"}}).pipeline_settings.overlap
    with pytest.raises(ArgumentsError) as info:
        parse(flag, ds={"pipeline": {"schedule": "1f1b", "overlap": False}})
    assert str(info.value) == (f'{flag} ("pipeline.overlap" = true) disagrees with ds_config "pipeline.overlap" = '
                               "false in ds.json; give one of them, or make them equal")
    with pytest.raises(ArgumentsError) as info:
        parse(flag, ds={"zero_optimization": {"stage": 1}, "pipeline": {"schedule": "zbv"}})
    assert 'overlapped forward-and-backward units are built for' in str(info.value)
