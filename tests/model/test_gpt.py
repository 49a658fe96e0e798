import pytest
import torch

from megatron_ds.model import GPTConfig, GPTModel, WeightGradStore, gpt_loss
from megatron_ds.model.positions import rope_tables, rotate


def tiny_config(**kw):
    base = dict(vocab_size=128, hidden_size=32, num_layers=2, num_attention_heads=4,
                max_position_embeddings=32, seed=7)
    base.update(kw)
    return GPTConfig(**base)


def batch(cfg, b=2, s=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (b, s + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def test_layer_init_depends_only_on_seed_and_index():
    a, b = GPTModel(tiny_config()), GPTModel(tiny_config())
    for (ka, pa), (kb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), ka
    # different layers draw different weights
    assert not torch.equal(a.layers[0].attn.c_attn.weight, a.layers[1].attn.c_attn.weight)


FAMILIES = {
    "gpt2": {},
    "llama": dict(normalization="rmsnorm", swiglu=True, position_embedding_type="rope", num_key_value_heads=2,
                  untie_embeddings_and_output_weights=True, add_bias_linear=False),
    "bloom": dict(position_embedding_type="alibi", embed_layernorm=True),
    "qwen3": dict(normalization="rmsnorm", swiglu=True, position_embedding_type="rope", num_key_value_heads=2,
                  untie_embeddings_and_output_weights=True, add_bias_linear=False, qk_layernorm=True),
}
FAMILIES["qwen3-kv16"] = dict(FAMILIES["qwen3"], kv_channels=16)  # heads of 16, not 32 / 4 (Qwen3-30B-A3B's 2x)


CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("family", FAMILIES)
def test_deferred_weight_grads_are_bit_identical_to_fused_backward(family, device):
    cfg = tiny_config(**FAMILIES[family])
    fused, split = GPTModel(cfg).to(device), GPTModel(cfg).to(device)
    tokens, labels = (t.to(device) for t in batch(cfg))
    gpt_loss(fused(tokens), labels).backward()

    loss = gpt_loss(split(tokens), labels)
    queue = []
    with WeightGradStore.deferring(queue):
        loss.backward()
    linear_weights = {n for n, _ in split.named_parameters() if n.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight"))
                      or n == "lm_head.weight"}
    assert queue, "B must defer the linear layers' weight GEMMs"
    for name, p in split.named_parameters():
        if name in linear_weights:
            assert p.grad is None, f"{name} got its weight gradient in B"
        else:
            assert p.grad is not None, f"{name} (norm, bias, embedding) must finish in B"
    WeightGradStore.drain(queue)
    for (name, pf), (_, ps) in zip(fused.named_parameters(), split.named_parameters()):
        assert torch.equal(pf.grad, ps.grad), name


def test_segment_loss_sums_to_full_loss():
    logits = torch.randn(2, 8, 11)
    labels = torch.randint(0, 11, (2, 8))
    full = gpt_loss(logits, labels)
    parts = gpt_loss(logits[:, :3], (labels[:, :3], labels.numel())) + gpt_loss(logits[:, 3:], (labels[:, 3:], labels.numel()))
    assert torch.allclose(full, parts, atol=1e-6)


def test_tied_head_copy_starts_equal_to_the_embedding():
    from megatron_ds.model import Embedding, TiedLMHead
    cfg = tiny_config()
    assert torch.equal(Embedding(cfg, 0).wte.weight, TiedLMHead(cfg, 0).wte.weight)


def test_impossible_family_options_are_refused_by_name():
    with pytest.raises(ValueError, match="--num-attention-heads \\(4\\) must be divisible by --num-key-value-heads \\(3\\)"):
        tiny_config(num_key_value_heads=3)
    with pytest.raises(ValueError, match="--normalization 'batchnorm'"):
        tiny_config(normalization="batchnorm")
    with pytest.raises(ValueError, match="head size"):
        tiny_config(hidden_size=36, position_embedding_type="rope")
    with pytest.raises(ValueError, match=r"^--kv-channels \(the head size\) must be a positive whole number, got 0$"):
        tiny_config(kv_channels=0)
    with pytest.raises(ValueError, match=r"the head size \(--kv-channels 7\) must be even"):
        tiny_config(kv_channels=7, position_embedding_type="rope")
    with pytest.raises(ValueError, match=r"--num-attention-heads \(4\) must be divisible by "
                                         r"--tensor-model-parallel-size \(3\)"):
        tiny_config(kv_channels=16, tensor_model_parallel_size=3)


def test_families_by_options():
    assert tiny_config().family == "gpt2"
    llama = tiny_config(normalization="rmsnorm", swiglu=True, position_embedding_type="rope", num_key_value_heads=2,
                        untie_embeddings_and_output_weights=True, add_bias_linear=False)
    assert llama.family == "llama" and llama.ffn_hidden_size == 64  # Megatron's swiglu width, at least 64
    assert tiny_config(position_embedding_type="alibi", embed_layernorm=True).family == "bloom"
    assert tiny_config(num_key_value_heads=2).family is None  # GPT-2 has no grouped-query attention
    assert tiny_config(**FAMILIES["qwen3"]).family == "qwen3"
    assert tiny_config(qk_layernorm=True).family is None  # Qwen3's per-head norms come with LLaMA's layout


def rope(q, k, theta):
    """q and k (b, heads, s, head_dim) rotated by the angles of positions 0..s-1, as the layer's tables do."""
    return rotate(q, k, *rope_tables(q.shape[-1], theta, 0, q.shape[-2], q.device, q.dtype))


def test_qk_layernorm_normalises_each_query_and_key_head_before_rope():
    """--qk-layernorm: q and k of every head RMS-normalised over head_dim (one weight vector per layer for all
    heads), then rotated; against the attention computed by hand."""
    import torch.nn.functional as F
    cfg = tiny_config(**FAMILIES["qwen3"])
    attn = GPTModel(cfg).layers[0].attn
    assert attn.q_norm.weight.shape == attn.k_norm.weight.shape == (cfg.head_dim,)
    with torch.no_grad():
        attn.q_norm.weight.normal_(1.0, 0.3, generator=torch.Generator().manual_seed(1))
        attn.k_norm.weight.normal_(1.0, 0.3, generator=torch.Generator().manual_seed(2))
    x = torch.randn(2, 6, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    q, k, v = F.linear(x, attn.c_attn.weight).split([32, 16, 16], dim=-1)
    heads = lambda t: t.view(2, 6, -1, cfg.head_dim)  # noqa: E731
    rms = lambda t, w: t / t.pow(2).mean(-1, keepdim=True).add(cfg.layernorm_epsilon).sqrt() * w  # noqa: E731
    q, k = rms(heads(q), attn.q_norm.weight).transpose(1, 2), rms(heads(k), attn.k_norm.weight).transpose(1, 2)
    q, k = rope(q, k, cfg.rope_theta)
    k, v = (t.repeat_interleave(2, dim=1) for t in (k, heads(v).transpose(1, 2)))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 6, 32)
    with torch.no_grad():
        torch.testing.assert_close(attn(x), F.linear(y, attn.c_proj.weight), rtol=1e-5, atol=1e-6)


def test_kv_channels_set_the_head_size_and_the_attention_widths():
    """--kv-channels 16 at hidden 32 / 4 heads (2 K/V heads): q is 4 x 16 = 64 wide, k and v 2 x 16, c_proj takes
    the 64 back to 32, the per-head norms are 16 wide, and the scores are scaled by 1/sqrt(16); against the
    attention computed by hand. The TP split's sections (model/universal_info.py) are those widths."""
    import torch.nn.functional as F
    from megatron_ds.model.universal_info import layer_parameters, universal_checkpoint_info
    from deepspeed.checkpoint import constants as C
    cfg = tiny_config(**FAMILIES["qwen3-kv16"])
    assert (cfg.head_dim, cfg.query_projection_size) == (16, 64)
    model = GPTModel(cfg)
    attn = model.layers[0].attn
    assert attn.c_attn.weight.shape == (128, 32) and attn.c_attn.sections == [64, 32, 32]
    assert attn.c_proj.weight.shape == (32, 64) and attn.q_norm.weight.shape == attn.k_norm.weight.shape == (16,)
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(3))
    q, k, v = F.linear(x, attn.c_attn.weight).split([64, 32, 32], dim=-1)
    heads = lambda t: t.view(2, 6, -1, 16)  # noqa: E731
    rms = lambda t, w: t / t.pow(2).mean(-1, keepdim=True).add(cfg.layernorm_epsilon).sqrt() * w  # noqa: E731
    q, k = rms(heads(q), attn.q_norm.weight).transpose(1, 2), rms(heads(k), attn.k_norm.weight).transpose(1, 2)
    q, k = rope(q, k, cfg.rope_theta)
    k, v = (t.repeat_interleave(2, dim=1) for t in (k, heads(v).transpose(1, 2)))
    scores = (q @ k.transpose(-1, -2) / 4.0).masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 6, 64)
    with torch.no_grad():
        torch.testing.assert_close(attn(x), F.linear(y, attn.c_proj.weight), rtol=1e-5, atol=1e-6)
    splits = layer_parameters(cfg)
    assert splits[(1, "attn.c_attn.weight")] == ("qkv", (64, 32, 32))
    assert {k for k in splits} == set(model.named_parameters_by_layer())
    info = universal_checkpoint_info(tiny_config(**FAMILIES["qwen3-kv16"], tensor_model_parallel_size=2), 128)
    assert list(info[C.SUB_PARAM_SHARD_WIDTHS].values()) == [[[32, 32], [16, 16], [16, 16]]]
