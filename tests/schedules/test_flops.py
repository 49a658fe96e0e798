"""schedules/flops.py, the one FLOP count: against hand formulas written from parameter counts
(2 FLOPs per parameter per token forward, plus causal attention), for a GPT-2 and a LLaMA-style
(GQA, SwiGLU, untied head) model; and the balanced Seq1F1B split, the "flops" partition and the
training log's TFLOP/s all use it."""
from types import SimpleNamespace

import pytest

from megatron_ds.pipe.plan.partition import layer_flops
from megatron_ds.schedules.flops import model_flops_per_sequence, span_flops
from megatron_ds.schedules.seq_split import balanced_segment_lengths, segment_costs


def gpt2(**kw):  # GPT-2 small: MHA, GELU MLP 4h, tied head
    return SimpleNamespace(**{**dict(hidden_size=768, num_layers=12, num_attention_heads=12, num_key_value_heads=None,
                                     ffn_hidden_size=3072, swiglu=False, padded_vocab_size=50304,
                                     max_position_embeddings=1024), **kw})


def llama(**kw):  # the LLaMA-style reference model: 16 layers, h 2048, 16 heads / 4 K/V heads, SwiGLU 5440, vocab 50304
    return SimpleNamespace(**{**dict(hidden_size=2048, num_layers=16, num_attention_heads=16, num_key_value_heads=4,
                                     ffn_hidden_size=5440, swiglu=True, vocab_size=50304,
                                     max_position_embeddings=2048), **kw})


def by_parameters(layer_params, layers, hidden, vocab, s, passes=3):
    """Hand formula: forward 2 x (linear parameters) per token, causal attention 2 h s^2 per layer."""
    forward = 2 * (layers * layer_params + hidden * vocab) * s + layers * 2 * hidden * s * s
    return passes * forward


def test_gpt2_count_equals_the_hand_formula():
    h, f, s = 768, 3072, 1024
    params = h * 3 * h + h * h + 2 * h * f  # c_attn (QKV), c_proj, c_fc, mlp c_proj (biases not counted)
    want = by_parameters(params, 12, h, 50304, s)
    assert model_flops_per_sequence(gpt2(), s) == pytest.approx(want, rel=1e-12)
    assert want == 3 * 2 * (12 * 7077888 + 38633472) * 1024 + 3 * 12 * 2 * 768 * 1024 ** 2
    # with activation recompute: one forward more
    assert model_flops_per_sequence(gpt2(), s, recompute=True) == pytest.approx(want * 4 / 3, rel=1e-12)


def test_llama_count_equals_the_hand_formula():
    h, kv, d, f, s = 2048, 4, 128, 5440, 2048
    params = h * (h + 2 * kv * d) + h * h + 3 * h * f  # Q + grouped K, V; output; gate, up, down
    want = by_parameters(params, 16, h, 50304, s)
    assert model_flops_per_sequence(llama(), s) == pytest.approx(want, rel=1e-12)
    # 16 sequences of 2048 tokens (its global batch): below Megatron's 184.8 TFLOP, which counts
    # the full s x s attention and GQA as MHA with a GELU MLP of 4h
    assert model_flops_per_sequence(llama(), s) * 16 / 1e12 == pytest.approx(171.58, abs=0.01)


def test_balanced_split_and_flops_partition_use_the_count():
    c = llama(max_position_embeddings=8192)
    shape = dict(heads=16, kv_heads=4, swiglu=True)
    lengths = balanced_segment_lengths(8192, 4, 2048, 5440, **shape)
    assert sum(lengths) == 8192 and lengths[0] > lengths[-1]
    costs = segment_costs(lengths, 2048, 5440, **shape)
    assert max(costs) - min(costs) < 0.02  # balanced within one 8-token step
    spans, start = [], 0
    for n in lengths:
        spans.append(span_flops(start, start + n, 2048, 5440, 16, 4, True))
        start += n
    assert costs == pytest.approx([x / (sum(spans) / 4) for x in spans])
    # GQA and SwiGLU change the split: the MHA/GELU count would cut it elsewhere
    assert balanced_segment_lengths(8192, 4, 2048, 5440) != lengths
    per_layer = layer_flops(c)[1]
    assert per_layer == pytest.approx(span_flops(0, 8192, 2048, 5440, 16, 4, True) / 8192)


def test_training_log_tflops_uses_the_count():
    from megatron_ds.training.logging_utils import mfu, tflops
    args = llama(seq_length=2048, checkpoint_activations=False, world_size=1, padded_vocab_size=50304)
    assert tflops(args, 16, 0.4109) == pytest.approx(171.58 / 0.4109, abs=0.05)
    assert mfu(400.0, 989.0) == pytest.approx(40.44, abs=0.01)
    assert mfu(400.0, None) is None


def test_device_peaks():
    from megatron_ds.training.device_peak import peak_bf16_tflops
    assert peak_bf16_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_bf16_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_bf16_tflops("NVIDIA H200") == 989.0
    assert peak_bf16_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_bf16_tflops("cpu") is None and peak_bf16_tflops(None) is None


def test_a_moe_layer_counts_the_experts_a_token_runs_through():
    """top-k experts of width f and the shared expert of width fs: the MLP of a dense layer of width k f + fs;
    dense layers of the same model keep their MLP (the TFLOP/s of the log and the "flops" cuts)."""
    from megatron_ds.gpt_config import GPTConfig
    from megatron_ds.moe_config import MoEConfig
    from megatron_ds.pipe.plan.partition import layer_flops
    from megatron_ds.schedules.flops import linear_flops_per_token, model_flops_per_sequence
    h, f, fe, fs, s = 32, 48, 16, 8, 16
    moe = MoEConfig(num_experts=8, router_topk=2, ffn_hidden_size=fe, shared_expert_intermediate_size=fs,
                    layer_freq=(0, 1))
    config = GPTConfig(vocab_size=64, hidden_size=h, num_layers=2, num_attention_heads=4, max_position_embeddings=s,
                       ffn_hidden_size=f, swiglu=True, moe=moe)
    dense = GPTConfig(vocab_size=64, hidden_size=h, num_layers=2, num_attention_heads=4, max_position_embeddings=s,
                      ffn_hidden_size=f, swiglu=True)
    mlp = lambda width: 3 * 2.0 * h * width  # noqa: E731
    difference = 3.0 * s * (mlp(2 * fe + fs) - mlp(f))  # forward + backward, one MoE layer of two
    assert model_flops_per_sequence(config, s) == pytest.approx(model_flops_per_sequence(dense, s) + difference)
    costs = layer_flops(config)
    assert costs[1] == pytest.approx(layer_flops(dense)[1])
    assert costs[2] - costs[1] == pytest.approx(linear_flops_per_token(h, 2 * fe + fs, swiglu=True)
                                                - linear_flops_per_token(h, f, swiglu=True))


def test_kv_channels_count_q_k_v_o_and_attention_heads_x_head_size_wide():
    """Qwen3-32B: h 5120, 64 query heads of --kv-channels 128 (queries 8192 wide, not h), 8 K/V heads, SwiGLU
    25600, untied vocab 151936. Q, K, V take h in, the output projection takes 8192 back to h, and each query's
    scores and weighted sum are 8192 wide (2 x 8192 x s^2 per layer over a causal sequence)."""
    from megatron_ds.gpt_config import GPTConfig
    h, q, kv, d, f, s, layers, vocab = 5120, 64 * 128, 8, 128, 25600, 4096, 64, 151936
    params = h * (q + 2 * kv * d) + q * h + 3 * h * f
    want = 3 * (2 * (layers * params + h * vocab) * s + layers * 2 * q * s * s)
    shape = dict(hidden_size=h, num_layers=layers, num_attention_heads=64, num_key_value_heads=kv, ffn_hidden_size=f,
                 swiglu=True, max_position_embeddings=s)
    flags = SimpleNamespace(**shape, kv_channels=d, padded_vocab_size=vocab)
    assert model_flops_per_sequence(flags, s) == pytest.approx(want, rel=1e-12)
    config = GPTConfig(**shape, vocab_size=vocab, kv_channels=d, normalization="rmsnorm",
                       position_embedding_type="rope", add_bias_linear=False)
    assert model_flops_per_sequence(config, s) == pytest.approx(want, rel=1e-12)
    assert layer_flops(config)[1] == pytest.approx(2 * params + 2 * q * s)  # per token, the "flops" partition's
    costs = segment_costs([1024, 3072], h, f, heads=64, kv_heads=kv, swiglu=True, head_dim=d)
    first = span_flops(0, 1024, h, f, 64, kv, True, head_dim=d)
    assert first == pytest.approx(2 * params * 1024 + 2 * q * 1024 ** 2)
    assert costs[0] == pytest.approx(first / ((first + span_flops(1024, s, h, f, 64, kv, True, head_dim=d)) / 2))
    # the default head size named is the count without it
    assert model_flops_per_sequence(llama(kv_channels=128), 2048) == model_flops_per_sequence(llama(), 2048)
