"""Our GPT-2, LLaMA, BLOOM, Qwen3, Mixtral and Qwen3-MoE equal Hugging Face's own models (fp32 logits, 1e-5),
loaded through hf.py both ways, and the state-dict conversion is bit-exact: HF -> ours -> HF and ours -> HF ->
ours; MoE models also from the files save_pretrained writes (one tensor per expert). A head_dim other than
hidden / heads (Qwen3-8B's and Qwen3-30B-A3B's 128) is --kv-channels: LLaMA, Qwen3 and Qwen3-MoE with it too."""
import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatron_ds.model import GPTModel, gpt_loss  # noqa: E402
from megatron_ds.convert.hf import (from_hf_state_dict, gpt_config_from_hf, hf_config_from_gpt,  # noqa: E402
                                  to_hf_state_dict)

VOCAB, HIDDEN, LAYERS, HEADS, SEQ = 96, 32, 2, 4, 16


def hf_configs():
    return {
        "gpt2": transformers.GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=SEQ,
                                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
        "llama": transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                          num_attention_heads=HEADS, num_key_value_heads=2, intermediate_size=48,
                                          max_position_embeddings=SEQ, rope_theta=500.0),
        "llama-tied-bias-mha": transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
            intermediate_size=40, max_position_embeddings=SEQ, tie_word_embeddings=True, attention_bias=True,
            mlp_bias=True),
        "bloom": transformers.BloomConfig(vocab_size=VOCAB, hidden_size=HIDDEN, n_layer=LAYERS, n_head=HEADS),
        "bloom-6-heads": transformers.BloomConfig(vocab_size=VOCAB, hidden_size=48, n_layer=LAYERS, n_head=6),
        "qwen3": transformers.Qwen3Config(**ROPE, intermediate_size=48, head_dim=HIDDEN // HEADS),
        # head_dim twice hidden / heads, as Qwen3-30B-A3B's 128 at 2048 / 32: q is 64 wide, k and v 32, o 64 -> 32
        "qwen3-head16": transformers.Qwen3Config(**ROPE, intermediate_size=48, head_dim=16),
        "llama-head4": transformers.LlamaConfig(**ROPE, intermediate_size=48, head_dim=4),
        "mixtral": transformers.MixtralConfig(**ROPE, intermediate_size=24, num_local_experts=4, rope_theta=500.0),
        "mixtral-top3-tied": transformers.MixtralConfig(**ROPE, intermediate_size=16, num_local_experts=6,
                                                        num_experts_per_tok=3, tie_word_embeddings=True),
        # experts in layers 0 and 2 (1 is dense), the top-2 of the softmax over all experts, not renormalised
        "qwen3_moe": transformers.Qwen3MoeConfig(**{**ROPE, "num_hidden_layers": 3}, intermediate_size=40,
                                                 moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                                                 mlp_only_layers=[1]),
        # experts in layers 1 and 3 (decoder_sparse_step 2: HF counts from 1), the top-2 renormalised
        "qwen3_moe-step2-norm": transformers.Qwen3MoeConfig(**{**ROPE, "num_hidden_layers": 4}, intermediate_size=40,
                                                            moe_intermediate_size=16, num_experts=4,
                                                            num_experts_per_tok=2, decoder_sparse_step=2,
                                                            norm_topk_prob=True),
        "qwen3_moe-head16": transformers.Qwen3MoeConfig(**{**ROPE, "num_hidden_layers": 3}, intermediate_size=40,
                                                        moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                                                        mlp_only_layers=[1], head_dim=16),
    }


ROPE = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
            num_key_value_heads=2, max_position_embeddings=SEQ)
FAMILY = {"gpt2": "gpt2", "llama": "llama", "llama-tied-bias-mha": "llama", "bloom": "bloom", "bloom-6-heads": "bloom",
          "qwen3": "qwen3", "mixtral": "mixtral", "mixtral-top3-tied": "mixtral", "qwen3_moe": "qwen3_moe",
          "qwen3_moe-step2-norm": "qwen3_moe", "qwen3-head16": "qwen3", "llama-head4": "llama",
          "qwen3_moe-head16": "qwen3_moe"}
MOE = [name for name in FAMILY if FAMILY[name] in ("mixtral", "qwen3_moe")]


def random_hf_model(name):
    """HF's model with every weight random and O(1) (HF's own init is too small to show layout errors)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_configs()[name]).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif p.dim() == 1:  # norm weights
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, 0.3 / p.shape[-1] ** 0.5 if "wpe" not in pname else 0.3)
    return model


def tokens(b=2, s=SEQ):
    return torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(5))


def hf_weights(model):
    return {k: v for k, v in model.state_dict().items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}


@pytest.mark.parametrize("name", list(FAMILY))
def test_logits_equal_hugging_face_loaded_from_its_state_dict(name):
    hf = random_hf_model(name)
    config = gpt_config_from_hf(hf.config)
    assert config.family == FAMILY[name]
    ours = GPTModel(config).eval()
    ours.load_parameters_by_layer(from_hf_state_dict(hf.state_dict(), config))
    x = tokens()
    with torch.no_grad():
        theirs, mine = hf(x).logits, ours(x)
    diff = (theirs - mine).abs().max().item()
    assert diff <= 1e-5, f"{name}: logits differ by {diff:.3g}"
    assert theirs.abs().max() > 1.0  # the comparison is not between near-zero numbers


@pytest.mark.parametrize("name", list(FAMILY))
def test_round_trip_is_bit_exact(name):
    hf = random_hf_model(name)
    config = gpt_config_from_hf(hf.config)
    original = hf_weights(hf)
    back = to_hf_state_dict(from_hf_state_dict(original, config), config)
    assert back.keys() == original.keys()
    for key, t in original.items():
        assert torch.equal(back[key], t), key
    ours = GPTModel(config).named_parameters_by_layer()
    again = from_hf_state_dict(to_hf_state_dict(ours, config), config)
    assert again.keys() == ours.keys()
    for key, p in ours.items():
        assert torch.equal(again[key], p), key


@pytest.mark.parametrize("name", list(FAMILY))
def test_our_model_exports_to_the_hf_class_that_computes_the_same(name):
    config = gpt_config_from_hf(hf_configs()[name], seed=3)
    ours = GPTModel(config).eval()
    hf_config = hf_config_from_gpt(config)
    assert gpt_config_from_hf(hf_config, max_position_embeddings=config.max_position_embeddings, seed=3) == config
    hf = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    assert type(hf).__name__ == hf_config.architectures[0]
    hf.load_state_dict(to_hf_state_dict(ours.named_parameters_by_layer(), config), strict=True)
    x = tokens()
    with torch.no_grad():
        diff = (hf(x).logits - ours(x)).abs().max().item()
    assert diff <= 1e-5, f"{name}: {diff:.3g}"


def test_llama_loss_equals_hf_loss_with_its_label_shift():
    hf = random_hf_model("llama")
    config = gpt_config_from_hf(hf.config)
    ours = GPTModel(config)
    ours.load_parameters_by_layer(from_hf_state_dict(hf.state_dict(), config))
    seq = tokens(s=SEQ + 1)  # HF predicts labels[:, 1:] from logits[:, :-1]: give it the whole sequence
    with torch.no_grad():
        theirs = hf(seq, labels=seq).loss
        mine = gpt_loss(ours(seq[:, :-1]), seq[:, 1:])
    assert abs(theirs.item() - mine.item()) <= 1e-5, (theirs.item(), mine.item())


def test_unsupported_hf_models_name_their_type():
    with pytest.raises(ValueError, match="model_type 'gptj'.*GPTJForCausalLM"):
        gpt_config_from_hf(transformers.GPTJConfig(architectures=["GPTJForCausalLM"]))
    with pytest.raises(ValueError, match="RoPE scaling type 'dynamic'"):  # linear, llama3, yarn: test_rope_scaling.py
        gpt_config_from_hf(transformers.LlamaConfig(rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                     "rope_theta": 1e4}))
    with pytest.raises(ValueError, match="activation_function"):
        gpt_config_from_hf(transformers.GPT2Config(activation_function="relu"))


def test_a_mix_of_options_no_family_has_is_refused_for_export():
    config = gpt_config_from_hf(hf_configs()["bloom"], swiglu=True, ffn_hidden_size=64)
    assert config.family is None
    with pytest.raises(ValueError, match="no Hugging Face family"):
        hf_config_from_gpt(config)
    for name in ("gpt2", "bloom"):  # their HF configs have no head size of their own
        config = gpt_config_from_hf(hf_configs()[name], kv_channels=16)
        assert config.family is None
        assert "--kv-channels 16: Hugging Face's GPT-2 and BLOOM have no head size" in _refusal(hf_config_from_gpt,
                                                                                                 config)


def test_head_dim_is_kv_channels_where_it_is_not_hidden_over_heads():
    """Qwen3Config's default head_dim is 128 whatever the hidden size: imported as --kv-channels 128 (the
    attention's widths follow), exported as head_dim 128; a head_dim equal to hidden / heads is no option."""
    config = gpt_config_from_hf(transformers.Qwen3Config(**ROPE))
    assert (config.kv_channels, config.head_dim, config.query_projection_size) == (128, 128, 512)
    attn = GPTModel(config).layers[0].attn
    assert attn.c_attn.weight.shape == (512 + 2 * 2 * 128, HIDDEN) and attn.c_proj.weight.shape == (HIDDEN, 512)
    assert attn.q_norm.weight.shape == (128,)
    assert hf_config_from_gpt(config).head_dim == 128
    assert gpt_config_from_hf(hf_configs()["qwen3"]).kv_channels is None  # head_dim 8 = 32 / 4
    assert hf_config_from_gpt(gpt_config_from_hf(hf_configs()["qwen3"])).head_dim == 8


@pytest.mark.parametrize("name", MOE)
def test_moe_models_load_from_the_files_save_pretrained_writes(name, tmp_path):
    """HF v5 holds the experts stacked, its files one tensor per expert (Mixtral's under block_sparse_moe):
    both give the same parameters."""
    from safetensors.torch import load_file
    hf = random_hf_model(name)
    hf.save_pretrained(tmp_path)
    files = load_file(tmp_path / "model.safetensors")
    config = gpt_config_from_hf(hf.config)
    first = min(i for i in range(config.num_layers) if config.is_moe_layer(i + 1))
    expert = "block_sparse_moe.experts.0.w1.weight" if FAMILY[name] == "mixtral" else "mlp.experts.0.gate_proj.weight"
    assert f"model.layers.{first}.{expert}" in files and files.keys() != hf.state_dict().keys()
    from_files, from_model = from_hf_state_dict(files, config), from_hf_state_dict(hf.state_dict(), config)
    assert from_files.keys() == from_model.keys()
    for key, t in from_model.items():
        assert torch.equal(from_files[key], t), key


def _refusal(make, *args, **kwargs):
    with pytest.raises(ValueError) as err:
        make(*args, **kwargs)
    message = str(err.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("make,needle", [
    (lambda: transformers.MixtralConfig(**ROPE, router_jitter_noise=0.1),
     "'mixtral' (architectures None) is not supported: router_jitter_noise 0.1"),
    (lambda: transformers.MixtralConfig(**ROPE, sliding_window=8), "sliding_window 8"),
    (lambda: transformers.Qwen3MoeConfig(**ROPE, head_dim=8, attention_bias=True), "attention_bias"),
    (lambda: transformers.Qwen3MoeConfig(**ROPE, mlp_only_layers=[0, 1]), "no layer with experts"),
])
def test_hf_options_our_layers_lack_are_refused_in_one_line(make, needle):
    assert needle in _refusal(gpt_config_from_hf, make())


MIXTRAL_LAYOUT = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS, num_attention_heads=HEADS,
                      max_position_embeddings=SEQ, normalization="rmsnorm", swiglu=True, position_embedding_type="rope",
                      add_bias_linear=False)


@pytest.mark.parametrize("options,needle", [
    (dict(shared_expert_intermediate_size=16), "--moe-shared-expert-intermediate-size (a shared expert): Mixtral and "
                                               "Qwen3-MoE have no such option"),
    (dict(score_function="sigmoid"), "--moe-router-score-function sigmoid"),
    (dict(capacity_factor=1.0), "--moe-expert-capacity-factor"),
    (dict(pre_softmax=True), "--moe-router-pre-softmax without --qk-layernorm"),
    (dict(layer_freq=(2,)), "--moe-layer-freq: Mixtral has experts in every layer"),
])
def test_export_refuses_moe_options_mixtral_and_qwen3_moe_lack(options, needle):
    from megatron_ds.gpt_config import GPTConfig
    from megatron_ds.moe_config import MoEConfig
    config = GPTConfig(**MIXTRAL_LAYOUT, moe=MoEConfig(num_experts=4, **options))
    assert config.family is None
    assert needle in _refusal(hf_config_from_gpt, config)
    biased = GPTConfig(**{**MIXTRAL_LAYOUT, "add_bias_linear": True}, moe=MoEConfig(num_experts=4))
    assert "without biases" in _refusal(hf_config_from_gpt, biased)


def test_router_aux_loss_maps_only_its_coefficient_hf_s_loss_is_k_times_megatrons_for_one_layer():
    """HF adds coef * load_balancing_loss_func iff output_router_logits; the coefficient maps both ways. For one
    layer HF's loss is E * sum_i f_i P_i, Megatron's (ours) E / k * sum_i f_i P_i: k times apart."""
    from megatron_ds.model.moe_router import aux_loss_weights, loss_inputs
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    on = gpt_config_from_hf(transformers.MixtralConfig(**ROPE, output_router_logits=True, router_aux_loss_coef=0.02))
    off = gpt_config_from_hf(transformers.MixtralConfig(**ROPE, router_aux_loss_coef=0.02))
    assert (on.moe.aux_loss_coeff, off.moe.aux_loss_coeff) == (0.02, 0.0)
    back = hf_config_from_gpt(on)
    assert back.output_router_logits and back.router_aux_loss_coef == 0.02
    assert not hf_config_from_gpt(off).output_router_logits
    m = dataclasses.replace(on.moe, aux_loss_coeff=1.0, router_topk=3)
    logits = torch.randn(40, m.num_experts, generator=torch.Generator().manual_seed(3))
    experts = torch.topk(logits, m.router_topk, dim=-1).indices
    inputs = loss_inputs(logits, experts, torch.ones_like(experts, dtype=torch.bool), m, batch=1)
    ours = (aux_loss_weights(inputs.counts, inputs.tokens, 1, m) * inputs.score_sums).sum()
    theirs = load_balancing_loss_func((logits,), m.num_experts, m.router_topk)
    assert theirs.item() == pytest.approx(m.router_topk * ours.item(), rel=1e-6)
    assert ours.item() > 1.0  # >= 1, equality only for a perfectly balanced router
