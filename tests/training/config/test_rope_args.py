"""RoPE scaling flags: Megatron's spellings (--use-rope-scaling, --rope-scaling-factor, --rotary-base,
--rotary-seq-len-interpolation-factor, --position-embedding-type yarn, --yarn-*) and ours (--rope-scaling-type ...)
resolve to one GPTConfig.rope_scaling, its flags rebuild it, a checkpoint compares it; a bad value or two
spellings that disagree stop the parse with one line (exit 2 from the entry point)."""
import argparse
import json
import os
import subprocess
import sys

import pytest

from megatron_ds.rope_scaling import RopeScaling
from megatron_ds.testing.launcher import child_env
from megatron_ds.training.config.arguments import ArgumentsError
from tests.training.config.test_model_args import BASE, LLAMA, config

pytestmark = pytest.mark.usefixtures("empty_corpus")  # tests/training/conftest.py

YARN = ["--rope-scaling-type", "yarn", "--rope-scaling-factor", "4", "--rope-scaling-original-max-position-embeddings",
        "32"]


def test_use_rope_scaling_is_megatrons_llama3_with_its_constants():
    c = config(*LLAMA, "--rotary-base", "500000", "--use-rope-scaling")
    assert c.rope_theta == 5e5 and c.family == "llama"
    assert c.rope_scaling == RopeScaling("llama3", 8.0, original_max_position_embeddings=8192, low_freq_factor=1.0,
                                         high_freq_factor=4.0)
    assert config(*LLAMA, "--use-rope-scaling", "--rope-scaling-factor", "32").rope_scaling.factor == 32.0
    spelt = config(*LLAMA, "--rope-scaling-type", "llama3", "--rope-scaling-factor", "8")
    assert spelt.rope_scaling == c.rope_scaling
    assert config(*LLAMA).rope_scaling is None


def test_every_parameter_has_its_flag():
    c = config(*LLAMA, "--rope-scaling-type", "llama3", "--rope-scaling-factor", "16", "--rope-scaling-low-freq-factor",
               "2", "--rope-scaling-high-freq-factor", "8", "--rope-scaling-original-max-position-embeddings", "64")
    assert c.rope_scaling.as_dict() == {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 2.0,
                                        "high_freq_factor": 8.0, "original_max_position_embeddings": 64}
    c = config(*LLAMA, *YARN, "--yarn-beta-fast", "16", "--yarn-beta-slow", "2", "--yarn-mscale", "0.7",
               "--yarn-mscale-all-dim", "0.5", "--yarn-attention-factor", "1.25")
    assert c.rope_scaling.as_dict() == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                        "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 0.7, "mscale_all_dim": 0.5,
                                        "attention_factor": 1.25}
    assert c.rope_scaling.attention_scale == 1.25


def test_megatron_spellings_of_linear_and_yarn():
    linear = config(*LLAMA, "--rotary-seq-len-interpolation-factor", "4")
    assert linear.rope_scaling == RopeScaling("linear", 4.0)
    assert config(*LLAMA, "--rope-scaling-type", "linear", "--rope-scaling-factor", "4") == linear
    yarn = config(*LLAMA[:3], "--position-embedding-type", "yarn", *LLAMA[5:], "--yarn-rotary-scaling-factor", "4",
                  "--yarn-original-max-position-embeddings", "32")
    assert yarn.position_embedding_type == "rope"
    assert yarn == config(*LLAMA, *YARN)


@pytest.mark.parametrize("flags", [
    ["--use-rope-scaling"], ["--rope-scaling-type", "linear", "--rope-scaling-factor", "2.5"], YARN,
    YARN + ["--yarn-beta-fast", "8", "--yarn-beta-slow", "2", "--yarn-mscale", "0.707", "--yarn-mscale-all-dim", "1"],
])
def test_model_family_flags_rebuild_the_scaling(flags):
    from megatron_ds.training.config.model_args import model_family_flags
    c = config(*LLAMA, *flags)
    assert c.rope_scaling is not None
    assert config(*model_family_flags(c), "--ffn-hidden-size", str(c.ffn_hidden_size)) == c


def test_a_checkpoint_compares_the_scaling():
    from megatron_ds.training.checkpoint.save_load import CheckpointError, _check_model_shape
    from tests.training.config.test_model_args import parse_args
    env = {"WORLD_SIZE": "1", "RANK": "0"}
    plain = parse_args(BASE + LLAMA, env=env).replace(padded_vocab_size=128).flags()
    scaled = parse_args(BASE + LLAMA + ["--use-rope-scaling"], env=env).replace(padded_vocab_size=128).flags()
    _check_model_shape(scaled, scaled, "ckpt", universal=False)
    with pytest.raises(CheckpointError, match="has rope_scaling=None, this run has {'rope_type': 'llama3'"):
        _check_model_shape(scaled, plain, "ckpt", universal=False)  # (this run, the checkpoint's saved args)
    with pytest.raises(CheckpointError, match="has rope_scaling={'rope_type': 'llama3'.*this run has None"):
        _check_model_shape(plain, scaled, "ckpt", universal=False)
    before = argparse.Namespace(**{k: v for k, v in vars(plain).items() if k != "rope_scaling"})  # saved before it
    _check_model_shape(plain, before, "ckpt", universal=False)
    with pytest.raises(CheckpointError, match="has rope_scaling=None, this run has {'rope_type'"):
        _check_model_shape(scaled, before, "ckpt", universal=False)


@pytest.mark.parametrize("extra,needle", [
    (["--use-rope-scaling", "--rope-scaling-type", "yarn"],
     "--use-rope-scaling (llama3) contradicts --rope-scaling-type (yarn): give one of them"),
    (["--rotary-seq-len-interpolation-factor", "2", "--rope-scaling-factor", "4", "--rope-scaling-type", "linear"],
     "--rotary-seq-len-interpolation-factor 2.0 disagrees with --rope-scaling-factor 4.0"),
    (["--rope-scaling-factor", "4"], "--rope-scaling-factor scales RoPE: add --rope-scaling-type llama3|linear|yarn"),
    (["--use-rope-scaling", "--yarn-beta-fast", "8"], "--yarn-beta-fast is no option of llama3 RoPE scaling"),
    (["--rope-scaling-type", "linear"], "RoPE scaling linear needs factor (--rope-scaling-factor)"),
    (["--rope-scaling-type", "yarn", "--rope-scaling-factor", "4"],
     "RoPE scaling yarn needs original_max_position_embeddings (--rope-scaling-original-max-position-embeddings)"),
    (["--use-rope-scaling", "--rope-scaling-factor", "0.5"], "--rope-scaling-factor must be at least 1"),
    (["--use-rope-scaling", "--rope-scaling-low-freq-factor", "4"],
     "--rope-scaling-low-freq-factor (4.0) and --rope-scaling-high-freq-factor (4.0): LLaMA 3.1's scaling needs "
     "0 < low < high"),
    (YARN + ["--yarn-beta-fast", "1", "--yarn-beta-slow", "2"], "YaRN needs 0 < beta_slow <= beta_fast"),
    (YARN + ["--yarn-attention-factor", "0"], "--yarn-attention-factor must be positive, got 0.0"),
    (["--use-rope-scaling", "--rope-scaling-original-max-position-embeddings", "0"],
     "--rope-scaling-original-max-position-embeddings must be a positive whole number, got 0"),
    (["--rope-scaling-factor", "inf", "--rope-scaling-type", "linear"],
     "--rope-scaling-factor must be a finite number"),
])
def test_bad_scaling_flags_name_the_flag(extra, needle):
    with pytest.raises(ArgumentsError) as err:
        config(*LLAMA, *extra)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_scaling_without_rope_is_refused():
    with pytest.raises(ArgumentsError, match="--position-embedding-type is learned_absolute, not rope"):
        config("--use-rope-scaling")


def test_bad_scaling_exits_2_with_one_line():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    proc = subprocess.run([sys.executable, os.path.join(root, "pretrain_gpt.py"), *BASE, *LLAMA, "--use-rope-scaling",
                           "--rope-scaling-type", "linear"],
                          capture_output=True, text=True, timeout=600, env=child_env(root))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "pretrain_gpt.py: error: --use-rope-scaling (llama3) contradicts --rope-scaling-type (linear): give one of "
        "them"]


def _with_ds_config(tmp_path, section, extra=()):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"rope_scaling": section}))
    return config(*LLAMA, *extra, "--deepspeed", "--deepspeed_config", str(path))


def test_the_ds_config_rope_scaling_section_is_the_flags(tmp_path):
    section = {"rope_scaling_type": "yarn", "rope_scaling_factor": 4,
               "rope_scaling_original_max_position_embeddings": 32, "yarn_beta_fast": 16}
    assert _with_ds_config(tmp_path, section) == config(*LLAMA, *YARN, "--yarn-beta-fast", "16")
    assert _with_ds_config(tmp_path, {"use_rope_scaling": True}) == config(*LLAMA, "--use-rope-scaling")
    agreeing = _with_ds_config(tmp_path, section, ["--rope-scaling-factor", "4", "--rope-scaling-type", "yarn"])
    assert agreeing.rope_scaling == RopeScaling("yarn", 4.0, original_max_position_embeddings=32, beta_fast=16.0)
    from tests.training.config.test_model_args import parse_args
    path = tmp_path / "ds.json"
    args = parse_args(BASE + LLAMA + ["--deepspeed", "--deepspeed_config", str(path)], env={"WORLD_SIZE": "1"})
    assert "rope_scaling" not in args.ds_config  # DeepSpeed gets its own keys alone


@pytest.mark.parametrize("section, extra, words", [
    ({"rope_scaling_factor": 8}, ["--rope-scaling-factor", "4", "--use-rope-scaling"],
     '--rope-scaling-factor 4.0 disagrees with ds_config "rope_scaling.rope_scaling_factor" = 8'),
    ({"rope_scaling_typ": "yarn"}, [], '"rope_scaling_typ" (did you mean "rope_scaling_type"?)'),
    ({"rope_scaling_type": "dynamic"}, [], "'dynamic' is not a value --rope-scaling-type takes"),
    ({"use_rope_scaling": True, "rope_scaling_type": "yarn"}, [],
     "--use-rope-scaling (llama3) contradicts --rope-scaling-type (yarn)"),
    ([2], [], 'ds_config "rope_scaling"'),
])
def test_a_wrong_ds_config_rope_scaling_section_stops_the_parse(tmp_path, section, extra, words):
    with pytest.raises(ArgumentsError) as info:
        _with_ds_config(tmp_path, section, extra)
    assert words in str(info.value) and "\n" not in str(info.value)


def test_a_training_runs_saved_args_give_the_tools_the_scaling(tmp_path):
    """What save_checkpoint writes of the run's args (plain values), read back weights-only as --load and the
    tools read it, rebuilds the same scaled GPTConfig (convert/model_args: the reference model's)."""
    import torch
    from megatron_ds.convert.model_args import config_from_args, with_defaults
    from megatron_ds.training.checkpoint import safe_load
    from megatron_ds.training.checkpoint.save_load import _plain_args
    from tests.training.config.test_model_args import parse_args
    args = parse_args(BASE + LLAMA + YARN + ["--yarn-mscale", "0.9", "--yarn-mscale-all-dim", "0.5"],
                      env={"WORLD_SIZE": "1", "RANK": "0"}).replace(padded_vocab_size=128)
    torch.save({"args": _plain_args(args)}, tmp_path / "mp_rank_00_model_states.pt")
    saved = safe_load.load(tmp_path / "mp_rank_00_model_states.pt")["args"]
    assert saved.rope_scaling == args.gpt_config.rope_scaling.as_dict()
    rebuilt = config_from_args(with_defaults(saved))
    assert rebuilt.rope_scaling == args.gpt_config.rope_scaling and rebuilt.rope_scaling.mscale == 0.9
