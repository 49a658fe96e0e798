"""The MoE flags: Megatron-core's names and Megatron-DeepSpeed's aliases build the run's MoEConfig; every
impossible setting stops the parse with one line naming the flag (exit 2), before any process group."""
import json

import pytest

from megatron_ds.moe_config import MoEConfig
from megatron_ds.training.config.arguments import parse_args
from megatron_ds.training.errors import ArgumentsError

BASE = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--lr", "1e-3", "--train-iters", "10", "--data-path", "corpus",
        "--vocab-file", __file__, "--merge-file", __file__]


pytestmark = pytest.mark.usefixtures("empty_corpus")  # tests/training/conftest.py


def parse(extra):
    return parse_args(BASE + extra, env={"WORLD_SIZE": "1", "RANK": "0"})


def test_megatron_core_flags_build_the_moe_config():
    args = parse(["--num-experts", "8", "--moe-router-topk", "4", "--moe-layer-freq", "([0]*1+[1]*3)",
                  "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                  "--moe-router-bias-update-rate", "0.01", "--moe-router-num-groups", "4", "--moe-router-group-topk",
                  "2", "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001", "--moe-ffn-hidden-size", "16",
                  "--moe-shared-expert-intermediate-size", "32", "--moe-router-topk-scaling-factor", "2.5"])
    assert args.gpt_config.moe == MoEConfig(num_experts=8, router_topk=4, layer_freq=(0, 1, 1, 1),
                                            score_function="sigmoid", enable_expert_bias=True, bias_update_rate=0.01,
                                            num_groups=4, group_topk=2, aux_loss_coeff=0.01, z_loss_coeff=0.001,
                                            ffn_hidden_size=16, shared_expert_intermediate_size=32,
                                            topk_scaling_factor=2.5)


def test_megatron_deepspeed_aliases():
    args = parse(["--num-experts", "4", "--topk", "1", "--moe-loss-coeff", "0.1", "--moe-train-capacity-factor",
                  "1.5", "--moe-expert-parallel-size", "1"])
    m = args.gpt_config.moe
    assert (m.num_experts, m.router_topk, m.aux_loss_coeff, m.capacity_factor) == (4, 1, 0.1, 1.5)
    assert m.ffn_hidden_size == args.gpt_config.ffn_hidden_size


def test_a_dense_model_has_no_moe():
    assert parse([]).gpt_config.moe is None


@pytest.mark.parametrize("extra, words", [
    (["--moe-router-topk", "2"], "--moe-router-topk configures experts: add --num-experts N"),
    (["--num-experts", "8", "--moe-router-topk", "9"], "--moe-router-topk (9) must be between 1 and --num-experts (8)"),
    (["--num-experts", "6", "--expert-model-parallel-size", "4"], "--expert-model-parallel-size"),
    (["--num-experts", "8", "--moe-router-num-groups", "3", "--moe-router-group-topk", "1"], "must divide --num-experts"),
    (["--num-experts", "8", "--moe-expert-capacity-factor", "0"], "--moe-expert-capacity-factor must be positive"),
    (["--num-experts", "8", "--expert-tensor-parallel-size", "2"], "--expert-tensor-parallel-size > 1"),
    (["--num-experts", "8", "--moe-layer-freq", "[0,1]"], "one 0 or 1 per layer (4)"),
    (["--num-experts", "8", "--moe-layer-freq", "os.system('x')"], "--moe-layer-freq"),
    (["--num-experts", "8", "4"], "give one count"),
])
def test_impossible_settings_stop_the_parse(extra, words):
    with pytest.raises(ArgumentsError) as info:
        parse(extra)
    assert words in str(info.value)


def test_expert_parallelism_must_divide_the_data_parallel_ranks():
    """Known from the launcher's world size before any process group: 6 ranks at PP 2 are 3 data-parallel ranks."""
    flags = BASE + ["--num-experts", "4", "--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    with pytest.raises(ArgumentsError) as info:
        parse_args(flags, env={"WORLD_SIZE": "6", "RANK": "0"})
    assert "--expert-model-parallel-size 2 must divide the data-parallel size 3" in str(info.value)
    assert parse_args(flags, env={"WORLD_SIZE": "8", "RANK": "0"}).gpt_config.moe.expert_model_parallel_size == 2


def test_capacity_with_sequence_segments_is_refused():
    from megatron_ds.gpt_config import GPTConfig
    from megatron_ds.pipe.plan.config import ConfigError
    from megatron_ds.pipe.plan.plan import make_plan
    config = GPTConfig(vocab_size=64, hidden_size=32, num_layers=4, num_attention_heads=4, max_position_embeddings=16,
                       moe=MoEConfig(num_experts=4, capacity_factor=1.0))
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "train_batch_size": 8,
          "zero_optimization": {"stage": 1}, "pipeline": {"schedule": "seq1f1b", "seq_splits": 2}}
    with pytest.raises(ConfigError, match="--moe-expert-capacity-factor with sequence segments"):
        make_plan(config, ds, 2, 1)
    make_plan(config, {**ds, "pipeline": {"schedule": "zb-h1"}}, 2, 1)


def test_moe_takes_tensor_parallelism(monkeypatch):
    args = parse_args(BASE + ["--num-experts", "4", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
                      env={"WORLD_SIZE": "2", "RANK": "0"})
    assert args.gpt_config.moe.num_experts == 4 and args.gpt_config.tensor_model_parallel_size == 2


@pytest.mark.parametrize("saved, now, words", [
    ([], ["--num-experts", "4"], "is dense, this run is a mixture of 4 experts"),
    (["--num-experts", "8"], ["--num-experts", "4"], "is a mixture of 8 experts, this run is a mixture of 4"),
    (["--num-experts", "4", "--moe-ffn-hidden-size", "16"], ["--num-experts", "4"], "--moe-ffn-hidden-size 16"),
    (["--num-experts", "4", "--moe-layer-freq", "2"], ["--num-experts", "4"], "--moe-layer-freq"),
    (["--num-experts", "4", "--moe-shared-expert-intermediate-size", "8"], ["--num-experts", "4"],
     "--moe-shared-expert-intermediate-size 8"),
])
def test_a_checkpoint_of_other_experts_is_refused(saved, now, words):
    from megatron_ds.training.checkpoint.save_load import _check_model_shape
    from megatron_ds.training.errors import CheckpointError
    theirs, ours = parse(saved), parse(now)
    with pytest.raises(CheckpointError) as info:
        _check_model_shape(ours, theirs, "ckpt", universal=False)
    assert words in str(info.value)
    _check_model_shape(ours, parse(now + ["--moe-router-topk", "1", "--moe-aux-loss-coeff", "0.1"]), "ckpt",
                       universal=False)  # the router's options may change


def _with_ds_config(tmp_path, config, extra=()):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    return parse([*extra, "--deepspeed", "--deepspeed_config", str(path)])


def test_the_ds_config_moe_section_is_the_flags(tmp_path):
    section = {"num_experts": 8, "moe_router_topk": 4, "moe_layer_freq": [0, 1, 1, 1], "moe_aux_loss_coeff": 0.01,
               "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True}
    args = _with_ds_config(tmp_path, {"moe": section})
    flags = parse(["--num-experts", "8", "--moe-router-topk", "4", "--moe-layer-freq", "([0]*1+[1]*3)",
                   "--moe-aux-loss-coeff", "0.01", "--moe-router-score-function", "sigmoid",
                   "--moe-router-enable-expert-bias"])
    assert args.gpt_config.moe == flags.gpt_config.moe and args.gpt_config.moe.router_topk == 4
    assert "moe" not in args.ds_config  # DeepSpeed gets its own keys alone
    agreeing = _with_ds_config(tmp_path, {"moe": section}, ["--num-experts", "8", "--moe-layer-freq", "0,1,1,1"])
    assert agreeing.gpt_config.moe == flags.gpt_config.moe


@pytest.mark.parametrize("section, extra, words", [
    ({"num_experts": 8}, ["--num-experts", "4"], '--num-experts 4 disagrees with ds_config "moe.num_experts" = 8'),
    ({"num_expert": 8}, [], '"num_expert" (did you mean "num_experts"?)'),
    ({"num_experts": 8, "moe_router_topk": "2"}, [], '"moe.moe_router_topk"'),
    ({"num_experts": 8, "moe_router_score_function": "relu"}, [], "'relu' is not a value --moe-router-score-function"),
    ({"num_experts": 8, "moe_grouped_gemm": 1}, [], "--moe-grouped-gemm"),
    ([8], [], 'ds_config "moe"'),
])
def test_a_wrong_ds_config_moe_section_stops_the_parse(tmp_path, section, extra, words):
    with pytest.raises(ArgumentsError) as info:
        _with_ds_config(tmp_path, {"moe": section}, extra)
    assert words in str(info.value)


def test_the_help_names_the_experts_count_n():
    import argparse
    from megatron_ds.training.config.moe_args import add_moe_args
    parser = argparse.ArgumentParser()
    add_moe_args(parser)
    text = parser.format_help()
    assert "--num-experts N [N ...]" in text and "NUM_EXPERTS" not in text
