"""Our GPT-2, LLaMA and BLOOM equal Hugging Face's own models (fp32 logits, 1e-5), loaded through
hf.py both ways, and the state-dict conversion is bit-exact: HF -> ours -> HF and ours -> HF -> ours."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatron_ds.model import GPTModel, gpt_loss  # noqa: E402
from megatron_ds.model.hf import (from_hf_state_dict, gpt_config_from_hf, hf_config_from_gpt,  # noqa: E402
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
    }


FAMILY = {"gpt2": "gpt2", "llama": "llama", "llama-tied-bias-mha": "llama", "bloom": "bloom", "bloom-6-heads": "bloom"}


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
    with pytest.raises(ValueError, match="RoPE scaling"):
        gpt_config_from_hf(transformers.LlamaConfig(rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                     "rope_theta": 1e4}))
    with pytest.raises(ValueError, match="activation_function"):
        gpt_config_from_hf(transformers.GPT2Config(activation_function="relu"))


def test_a_mix_of_options_no_family_has_is_refused_for_export():
    config = gpt_config_from_hf(hf_configs()["bloom"], swiglu=True, ffn_hidden_size=64)
    assert config.family is None
    with pytest.raises(ValueError, match="no Hugging Face family"):
        hf_config_from_gpt(config)
