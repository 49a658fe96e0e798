"""Model-family flags: Megatron-DeepSpeed / Megatron-LM / BigScience spellings resolve to one
GPTConfig; impossible combinations fail at start-up with one message (exit 2)."""
import os
import subprocess
import sys

import pytest

from megatron_ds.testing.launcher import child_env
from megatron_ds.training.config.arguments import ArgumentsError, parse_args
from megatron_ds.training.config.model_args import gpt_config_from_args, model_family_flags

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--lr", "1e-3", "--train-iters", "10", "--data-path", "corpus",
        "--vocab-file", __file__, "--merge-file", __file__]
LLAMA = ["--normalization", "rmsnorm", "--swiglu", "--position-embedding-type", "rope", "--num-key-value-heads", "2",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--ffn-hidden-size", "48"]


pytestmark = pytest.mark.usefixtures("empty_corpus")  # tests/training/conftest.py


def config(*extra):
    args = parse_args(BASE + list(extra), env={"WORLD_SIZE": "1", "RANK": "0"})
    args = args.replace(padded_vocab_size=128)  # the tokenizer's, at start-up
    return gpt_config_from_args(args)


def test_defaults_are_gpt2():
    c = config()
    assert c.family == "gpt2" and c.num_key_value_heads == 4 and c.tied_head and c.ffn_hidden_size == 128


def test_llama_flags():
    c = config(*LLAMA, "--rope-theta", "500000")
    assert c.family == "llama"
    assert (c.normalization, c.swiglu, c.position_embedding_type, c.rope_theta) == ("rmsnorm", True, "rope", 5e5)
    assert (c.num_key_value_heads, c.untie_embeddings_and_output_weights, c.add_bias_linear) == (2, True, False)


@pytest.mark.parametrize("spelling", [
    ["--normalization", "RMSNorm", "--glu-activation", "swiglu", "--use-rotary-position-embeddings",
     "--group-query-attention", "--num-query-groups", "2"],  # Megatron-LM / BigScience
    ["--normalization", "rmsnorm", "--swiglu", "--position-embedding-type", "rotary", "--num-key-value-heads", "2"],
])
def test_other_spellings_give_the_same_model(spelling):
    common = ["--untie-embeddings-and-output-weights", "--disable-bias-linear", "--ffn-hidden-size", "48"]
    assert config(*spelling, *common) == config(*LLAMA)


def test_bloom_flags():
    c = config("--position-embedding-type", "alibi", "--embed-layernorm")
    assert c.family == "bloom" and c.embed_layernorm and c.tied_head


def test_qwen3_and_moe_flags():
    assert config(*LLAMA, "--qk-layernorm").family == "qwen3"
    mixtral = config(*LLAMA, "--num-experts", "4")
    assert mixtral.family == "mixtral" and mixtral.moe.ffn_hidden_size == 48
    qwen3_moe = config(*LLAMA, "--qk-layernorm", "--num-experts", "4", "--moe-router-pre-softmax")
    assert qwen3_moe.qk_layernorm and qwen3_moe.moe.pre_softmax and qwen3_moe.family == "qwen3_moe"


QWEN3_MOE = LLAMA + ["--qk-layernorm", "--num-experts", "4", "--moe-router-topk", "1", "--moe-ffn-hidden-size", "16",
                     "--moe-router-pre-softmax", "--moe-layer-freq", "[0,1]", "--moe-aux-loss-coeff", "0.01",
                     "--moe-z-loss-coeff", "0.001"]


@pytest.mark.parametrize("flags", [[], LLAMA + ["--rope-theta", "5e5"], ["--position-embedding-type", "alibi",
                                                                       "--embed-layernorm"], QWEN3_MOE,
                                   LLAMA + ["--num-experts", "4", "--moe-layer-freq", "2"],
                                   QWEN3_MOE + ["--kv-channels", "16"]])
def test_flags_of_a_config_give_it_back(flags):
    c = config(*flags)
    assert config(*model_family_flags(c), "--ffn-hidden-size", str(c.ffn_hidden_size)) == c


def test_kv_channels_sets_the_head_size():
    """Megatron's --kv-channels: heads x kv_channels wide queries (here 4 x 16 = 64 at hidden 32); hidden / heads
    given is the flag left out (one model, one config, one saved value)."""
    c = config(*LLAMA, "--qk-layernorm", "--kv-channels", "16")
    assert (c.kv_channels, c.head_dim, c.query_projection_size, c.family) == (16, 16, 64, "qwen3")
    flags = model_family_flags(c)
    assert flags[flags.index("--kv-channels") + 1] == "16"
    assert config(*LLAMA, "--kv-channels", "8") == config(*LLAMA) and config(*LLAMA).head_dim == 8
    assert config("--kv-channels", "16").family is None  # HF GPT-2 has no head size of its own


def test_a_checkpoint_of_another_head_size_is_refused_one_saved_before_the_flag_has_none():
    import argparse
    from megatron_ds.training.checkpoint.save_load import MODEL_ARGS, _check_model_shape
    from megatron_ds.training.errors import CheckpointError

    def args(*extra):
        return parse_args(BASE + LLAMA + list(extra), env={"WORLD_SIZE": "1", "RANK": "0"})
    wide, plain = args("--kv-channels", "16"), args()
    assert "kv_channels" in MODEL_ARGS and plain.kv_channels is None
    _check_model_shape(wide, args("--kv-channels", "16"), "ckpt", universal=False)
    _check_model_shape(plain, args("--kv-channels", "8"), "ckpt", universal=False)  # 32 / 4: the default
    with pytest.raises(CheckpointError, match="has kv_channels=16, this run has None: the models differ"):
        _check_model_shape(plain, wide, "ckpt", universal=False)
    before = argparse.Namespace(**{k: v for k, v in vars(plain).items() if k != "kv_channels"})
    _check_model_shape(plain, before, "ckpt", universal=False)
    with pytest.raises(CheckpointError, match="has kv_channels=None, this run has 16"):
        _check_model_shape(wide, before, "ckpt", universal=False)


def test_swiglu_default_ffn_size_is_megatrons():
    assert config("--swiglu", "--hidden-size", "256").ffn_hidden_size == 640  # int(4 * 256 * 2/3) // 64 * 64


@pytest.mark.parametrize("extra,needle", [
    (["--num-key-value-heads", "3"], "--num-attention-heads (4) must be divisible by --num-key-value-heads (3)"),
    (["--group-query-attention"], "--group-query-attention needs --num-query-groups"),
    (["--num-query-groups", "2"], "--num-query-groups needs --group-query-attention"),
    (["--group-query-attention", "--num-query-groups", "2", "--num-key-value-heads", "1"],
     "--num-query-groups 2 disagrees with --num-key-value-heads 1"),
    (["--use-rotary-position-embeddings", "--position-embedding-type", "alibi"],
     "--use-rotary-position-embeddings contradicts --position-embedding-type alibi"),
    (["--position-embedding-type", "rope", "--hidden-size", "36", "--num-attention-heads", "4"],
     "head size"),
    (["--position-embedding-type", "rope", "--rope-theta", "0"], "--rope-theta must be positive"),
    (["--kv-channels", "0"], "--kv-channels (the head size) must be a positive whole number, got 0"),
    (["--position-embedding-type", "rope", "--kv-channels", "7"],
     "rotates pairs of channels: the head size (--kv-channels 7) must be even"),
])
def test_impossible_combinations_name_the_flags(extra, needle):
    with pytest.raises(ArgumentsError) as err:
        config(*extra)
    assert needle in str(err.value)


def test_bad_model_flags_exit_2_with_one_message():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    proc = subprocess.run([sys.executable, os.path.join(root, "pretrain_gpt.py"), *BASE, "--num-key-value-heads", "3"],
                          capture_output=True, text=True, timeout=600, env=child_env(root))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "pretrain_gpt.py: error: --num-attention-heads (4) must be divisible by --num-key-value-heads (3): "
        "each K/V head serves a whole group of query heads"]
    proc = subprocess.run([sys.executable, os.path.join(root, "pretrain_gpt.py"), *BASE, "--normalization", "batchnorm"],
                          capture_output=True, text=True, timeout=600, env=child_env(root))
    assert proc.returncode == 2 and "--normalization: invalid choice: 'batchnorm'" in proc.stderr
    proc = subprocess.run([sys.executable, os.path.join(root, "pretrain_gpt.py"), *BASE, "--kv-channels", "-4"],
                          capture_output=True, text=True, timeout=600, env=child_env(root))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "pretrain_gpt.py: error: --kv-channels (the head size) must be a positive whole number, got -4"]


def test_one_gpt_config_from_the_flags_at_parse_time():
    """parse_args builds the run's GPTConfig once (torch-free): the parallel checks and the pipeline plan read
    its FFN size, SwiGLU's 2/3 of 4h rounded to 64 (here 256, not 4h = 384, which TP=3 would divide)."""
    flags = ["--hidden-size", "96", "--num-attention-heads", "3", "--swiglu"]
    args = parse_args(BASE + flags, env={"WORLD_SIZE": "1", "RANK": "0"})
    assert args.gpt_config.ffn_hidden_size == 256 and args.gpt_config.vocab_size is None
    with pytest.raises(ArgumentsError, match=r"--ffn-hidden-size \(256\) must be divisible by "
                                             r"--tensor-model-parallel-size \(3\)"):
        parse_args(BASE + flags + ["--tensor-model-parallel-size", "3"], env={"WORLD_SIZE": "3", "RANK": "0"})


def test_liger_kernel_needs_its_package_a_gpu_and_no_loss_chunks():
    import importlib.util
    import torch
    with pytest.raises(ArgumentsError, match="--use-liger-kernel and --loss-chunk-size"):
        config(*LLAMA, "--use-liger-kernel", "--loss-chunk-size", "64")
    if importlib.util.find_spec("liger_kernel") is None:
        with pytest.raises(ArgumentsError, match="not importable.*pip install liger-kernel"):
            config(*LLAMA, "--use-liger-kernel")
    elif not torch.cuda.is_available():
        with pytest.raises(ArgumentsError, match="Triton's, for CUDA"):
            config(*LLAMA, "--use-liger-kernel")
    else:
        assert config(*LLAMA, "--use-liger-kernel").liger_kernel
