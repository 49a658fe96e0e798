"""Context parallelism's flags and ds_config section: merged, checked at parse time, one line each (no torch)."""

import pytest

from megatron_ds.pipe.plan.config import ConfigError
from megatron_ds.pipe.plan.plan import make_plan
from megatron_ds.pipe.plan.segments import context_shards, segment_lengths, segment_multiple
from megatron_ds.pipe.plan.config import pipeline_settings
from megatron_ds.gpt_config import GPTConfig
from megatron_ds.training.config.arguments import ArgumentsError
from tests.training.config.parsing import parse_with

BASE = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
        "--lr", "1e-3", "--train-iters", "10", "--data-path", "corpus", "--vocab-file", __file__,
        "--merge-file", __file__, "--micro-batch-size", "1", "--global-batch-size", "4", "--attention-dropout", "0"]
ONE_F_ONE_B = {"pipeline": {"schedule": "1f1b"}}

pytestmark = pytest.mark.usefixtures("empty_corpus")  # tests/training/conftest.py


def parse(*extra, world=8, ds=None, tmp_path=None):
    return parse_with(BASE, *extra, world=world, ds=ds, folder=tmp_path)


def test_the_flags_reach_the_model_and_the_data_parallel_size(tmp_path):
    args = parse("--context-parallel-size", "2", "--cp-comm-type", "allgather", "--pipeline-model-parallel-size", "2",
                 ds=ONE_F_ONE_B, tmp_path=tmp_path)
    assert (args.context_parallel_size, args.cp_comm_type, args.data_parallel_size) == (2, "allgather", 2)
    assert (args.gpt_config.context_parallel_size, args.gpt_config.cp_comm_type) == (2, "allgather")
    # Megatron's batch: global = micro x steps x DP (the CP ranks of a replica read the same samples)
    assert (args.gradient_accumulation_steps, args.ds_config["train_batch_size"]) == (2, 4)
    assert "context_parallel" not in args.ds_config  # ours: DeepSpeed never sees it
    assert args.pipeline_plan.context_shards == 2
    assert args.pipeline_plan.message_shape((0, 0, 0, 0)) == (1, 16, 32)  # (b, s / CP, h)


def test_deepspeed_s_own_engine_takes_it_too():
    args = parse("--context-parallel-size", "2", "--pipeline-model-parallel-size", "2")
    assert args.pipeline_settings.stock and args.pipeline_plan is None and args.gpt_config.context_parallel_size == 2


def test_the_defaults_are_one_rank_and_the_ring():
    args = parse(world=1)
    assert (args.context_parallel_size, args.cp_comm_type, args.data_parallel_size) == (1, "p2p", 1)


def test_the_ds_config_section_gives_them_too(tmp_path):
    args = parse(world=4, tmp_path=tmp_path,
                 ds={**ONE_F_ONE_B, "context_parallel": {"context_parallel_size": 4, "cp_comm_type": "a2a"}})
    assert (args.context_parallel_size, args.cp_comm_type, args.data_parallel_size) == (4, "a2a", 1)


@pytest.mark.parametrize("extra, ds, needle", [
    (["--context-parallel-size", "2"], {"context_parallel": {"context_parallel_size": 4}},
     '--context-parallel-size 2 disagrees with ds_config "context_parallel.context_parallel_size" = 4'),
    ([], {"context_parallel": {"size": 2}}, "ds_config \"context_parallel\" has unknown key 'size'"),
    ([], {"context_parallel": {"cp_comm_type": "ring"}}, "\"context_parallel.cp_comm_type\" = 'ring': one of"),
    ([], {"context_parallel": 2}, 'ds_config "context_parallel" must be an object'),
])
def test_a_section_that_disagrees_or_is_wrong_is_one_line(tmp_path, extra, ds, needle):
    with pytest.raises(ArgumentsError) as err:
        parse(*extra, ds={**ONE_F_ONE_B, **ds}, tmp_path=tmp_path)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_hierarchical_sizes_reach_the_model_from_the_flags_or_the_section(tmp_path):
    args = parse("--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes",
                 "2", "2", ds=ONE_F_ONE_B, tmp_path=tmp_path)
    assert (args.cp_comm_type, args.hierarchical_context_parallel_sizes, args.data_parallel_size) == ("a2a+p2p", (2, 2),
                                                                                                      2)
    assert args.gpt_config.hierarchical_context_parallel_sizes == (2, 2)
    section = {"context_parallel_size": 8, "cp_comm_type": "a2a+p2p", "hierarchical_context_parallel_sizes": [2, 4]}
    args = parse(ds={**ONE_F_ONE_B, "context_parallel": section}, tmp_path=tmp_path)
    assert (args.context_parallel_size, args.gpt_config.hierarchical_context_parallel_sizes) == (8, (2, 4))
    assert parse(world=1).hierarchical_context_parallel_sizes is None


@pytest.mark.parametrize("extra, section, needle", [
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2", "4"],
     {}, "--hierarchical-context-parallel-sizes 2 4: their product 8 must equal --context-parallel-size 4"),
    (["--context-parallel-size", "4", "--hierarchical-context-parallel-sizes", "2", "2"], {},
     "--hierarchical-context-parallel-sizes is --cp-comm-type a2a+p2p's: --cp-comm-type is p2p"),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p"], {},
     "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A P"),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "1", "4"],
     {}, "each must be at least 2 (A = 1 is --cp-comm-type p2p, P = 1 is a2a)"),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "4", "1"],
     {}, "each must be at least 2"),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2", "2"],
     {"hierarchical_context_parallel_sizes": [4, 1]}, "--hierarchical-context-parallel-sizes 2 2 disagrees with ds_config"),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p"], {"hierarchical_context_parallel_sizes": 4},
     '"context_parallel.hierarchical_context_parallel_sizes" = 4: two whole numbers [A, P]'),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "4", "1",
      "--num-attention-heads", "8", "--num-key-value-heads", "2"], {}, "each must be at least 2"),
    (["--context-parallel-size", "8", "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "4", "2",
      "--num-attention-heads", "8", "--num-key-value-heads", "2"], {},
     "the 2 K/V heads must be divisible by 4"),
])
def test_hierarchical_sizes_that_cannot_run_are_one_line(tmp_path, extra, section, needle):
    ds = {**ONE_F_ONE_B, "context_parallel": section} if section else ONE_F_ONE_B
    with pytest.raises(ArgumentsError) as err:
        parse(*extra, ds=ds, tmp_path=tmp_path)
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("extra, world, needle", [
    (["--context-parallel-size", "3"], 8, "--context-parallel-size 3 x --pipeline-model-parallel-size 1 = 3 must "
                                          "divide the world size 8 (the data-parallel size is world / (TP x CP x PP))"),
    (["--context-parallel-size", "2", "--seq-length", "30"], 8, "--seq-length (30) must be divisible by 2 x "
                                                                "--context-parallel-size (4)"),
    (["--context-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel", "--seq-length", "36"],
     8, "must be divisible by 2 x --context-parallel-size x --tensor-model-parallel-size (--sequence-parallel) (8)"),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a", "--num-key-value-heads", "2"], 8,
     "--cp-comm-type a2a shares the attention heads out"),
    (["--context-parallel-size", "2", "--cp-comm-type", "ring"], 8, "invalid choice: 'ring'"),
])
def test_a_layout_that_cannot_run_stops_at_parse_time(tmp_path, capsys, extra, world, needle):
    with pytest.raises((ArgumentsError, SystemExit)) as err:
        parse(*extra, world=world, ds=ONE_F_ONE_B, tmp_path=tmp_path)
    text = str(err.value) if err.type is ArgumentsError else capsys.readouterr().err
    assert needle in text


@pytest.mark.parametrize("cp, seq, ds, needle", [
    (2, 32, {"pipeline": {"schedule": "auto", "memory_budget": 4, "auto_recompute": True}},
     '--context-parallel-size 2 with ds_config "pipeline.auto_recompute": true'),
    (4, 40, {"pipeline": {"schedule": "seq1f1b", "seq_splits": 2, "seq_split_method": "even"}},
     "cuts --seq-length 40 into [20, 20], and [20, 20] are not multiples of 2 x --context-parallel-size (8)"),
])
def test_what_context_parallelism_does_not_run_with_is_named(tmp_path, cp, seq, ds, needle):
    with pytest.raises(ArgumentsError) as err:
        parse("--context-parallel-size", str(cp), "--seq-length", str(seq), "--pipeline-model-parallel-size", "2",
              ds=ds, tmp_path=tmp_path)
    assert needle in str(err.value)


def test_the_moe_capacity_factor_is_refused_under_context_parallelism(tmp_path):
    with pytest.raises(ArgumentsError, match="--context-parallel-size 2 with --moe-expert-capacity-factor"):
        parse("--context-parallel-size", "2", "--num-experts", "4", "--moe-expert-capacity-factor", "1.0",
              ds=ONE_F_ONE_B, tmp_path=tmp_path)


def test_experts_are_shared_out_over_data_times_context_parallel_ranks(tmp_path):
    args = parse("--context-parallel-size", "2", "--num-experts", "4", "--expert-model-parallel-size", "4",
                 world=4, ds=ONE_F_ONE_B, tmp_path=tmp_path)
    assert args.data_parallel_size == 2 and args.gpt_config.moe.expert_model_parallel_size == 4  # EP 4 of DP 2 x CP 2
    with pytest.raises(ArgumentsError, match=r"--expert-model-parallel-size 4 must divide the data-parallel x "
                                             r"context-parallel size 1 x 2 = 2: an expert-parallel group is made of "
                                             "data-parallel and context-parallel ranks"):
        parse("--context-parallel-size", "2", "--num-experts", "4", "--expert-model-parallel-size", "4",
              world=2, ds=ONE_F_ONE_B, tmp_path=tmp_path)


def config(cp, **kw):
    return GPTConfig(vocab_size=64, hidden_size=32, num_layers=4, num_attention_heads=4, max_position_embeddings=256,
                     context_parallel_size=cp, **kw)


def test_balanced_segments_are_multiples_of_2cp_and_cost_what_they_cost_without_cp():
    settings = pipeline_settings({"pipeline": {"schedule": "seq1f1b", "seq_splits": 4}})
    assert segment_multiple(config(1)) == 8 and segment_multiple(config(4)) == 8 and segment_multiple(config(8)) == 16
    assert segment_multiple(config(2, tensor_model_parallel_size=4, sequence_parallel=True)) == 16
    lengths = segment_lengths(settings, config(8), 256)
    assert sum(lengths) == 256 and all(n % 16 == 0 for n in lengths)
    assert segment_lengths(settings, config(1), 256) == [80, 64, 56, 56]  # without CP: multiples of 8
    assert lengths == [80, 64, 48, 64]
    assert context_shards(8, 1, False, 256, lengths) == 8


def test_the_plan_cuts_messages_and_carriers_to_the_local_tokens():
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "zero_optimization": {"stage": 1},
          "pipeline": {"schedule": "seq1f1b", "seq_splits": 2, "seq_split_method": "even"}}
    plan, _ = make_plan(config(2), ds, 2, 1, 64)
    assert plan.segment_lengths == (32, 32) and plan.context_shards == 2
    assert [plan.local_length(s) for s in (0, 1)] == [16, 16]
    assert plan.message_shape((0, 0, 0, 1)) == (2, 16, 32)
    with pytest.raises(ConfigError, match=r"\[20, 20\] are not multiples of 2 x --context-parallel-size \(8\)"):
        make_plan(config(4), ds, 2, 1, 40)


def test_a_byte_budget_counts_a_rank_s_share_of_the_tokens():
    """"auto"'s memory unit (one micro-batch's activations on a stage) and the logits hold 1/CP of the tokens
    on a context-parallel rank: the same bytes are CP times as many units."""
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4, "zero_optimization": {"stage": 1},
          "pipeline": {"schedule": "auto", "memory_budget": "64MiB"}}
    plans = {cp: make_plan(config(cp), ds, 2, 1, 256)[1] for cp in (1, 2)}
    assert plans[2].budget == pytest.approx(2 * plans[1].budget) and plans[1].budget > 4
    assert plans[2].head_memory == pytest.approx(plans[1].head_memory)  # the logits, in units: the same share
