"""Long-context RoPE scaling through Hugging Face, both ways: tiny LLaMA-3.1-style (llama3), LLaMA linear and Qwen3
YaRN models built from transformers' config classes (original context 32, max 128) give the logits of
transformers' own models (fp32, 1e-5) over 96 positions, two thirds of them past the original context, where the
scaling is seen to matter; the state dict and the config's rope_parameters come back bit for bit; and through the
tools (import_hf -> checkpoint -> export_hf) the saved args carry the scaling to the reference model, its greedy
generation (transformers' generate, past the original context) and back."""
import dataclasses
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatron_ds.convert.hf import (from_hf_state_dict, gpt_config_from_hf, hf_config_from_gpt,  # noqa: E402
                                    to_hf_state_dict)
from megatron_ds.model import GPTModel  # noqa: E402
from tests.convert.helpers import tool  # noqa: E402

ORIGINAL, SEQ, MAX = 32, 96, 128
SCALINGS = {
    "llama3": ("LlamaConfig", dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                   original_max_position_embeddings=ORIGINAL, rope_theta=500.0)),
    "linear": ("LlamaConfig", dict(rope_type="linear", factor=4.0, rope_theta=10000.0)),
    "yarn": ("Qwen3Config", dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIGINAL,
                                 rope_theta=10000.0)),
    # DeepSeek-style mscales (the attention factor their ratio) and narrower betas: a wider ramp
    "yarn-mscale-betas": ("Qwen3Config", dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIGINAL,
                                              beta_fast=8.0, beta_slow=0.5, mscale=0.9, mscale_all_dim=0.5,
                                              rope_theta=1000.0)),
    "yarn-attention-factor": ("LlamaConfig", dict(rope_type="yarn", factor=4.0, attention_factor=1.5,
                                                  original_max_position_embeddings=ORIGINAL, rope_theta=10000.0)),
}


def hf_config(name, vocab=96):
    cls, rope = SCALINGS[name]
    return getattr(transformers, cls)(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, intermediate_size=96,
                                      max_position_embeddings=MAX, rope_parameters=dict(rope),
                                      tie_word_embeddings=False, bos_token_id=vocab - 1, eos_token_id=vocab - 1)


def random_hf_model(name, vocab=96):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(name, vocab)).eval()
    with torch.no_grad():  # O(1) weights (HF's own init is too small to show a wrong rotation)
        for p in model.parameters():
            p.normal_(1.0, 0.1) if p.dim() == 1 else p.normal_(0.0, 0.5 / p.shape[-1] ** 0.5)
    return model


def tokens(vocab=96):
    return torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("name", SCALINGS)
def test_logits_equal_transformers_past_the_original_context(name):
    hf = random_hf_model(name)
    config = gpt_config_from_hf(hf.config)
    assert config.rope_scaling.rope_type == SCALINGS[name][1]["rope_type"]
    ours = GPTModel(config).eval()
    ours.load_parameters_by_layer(from_hf_state_dict(hf.state_dict(), config))
    unscaled = GPTModel(dataclasses.replace(config, rope_scaling=None)).eval()
    unscaled.load_state_dict(ours.state_dict())
    x = tokens()
    with torch.no_grad():
        theirs, mine, plain = hf(x).logits, ours(x), unscaled(x)
    late = slice(ORIGINAL, SEQ)
    diff = (theirs - mine).abs().max().item()
    assert diff <= 1e-5, f"{name}: logits differ by {diff:.3g}"
    assert (theirs[:, late] - mine[:, late]).abs().max().item() <= 1e-5
    assert theirs.abs().max() > 1.0  # not a comparison of near-zero numbers
    # the scaling is what makes them equal: without it the late positions differ
    assert (theirs[:, late] - plain[:, late]).abs().max().item() > 1e-2


@pytest.mark.parametrize("name", SCALINGS)
def test_import_export_is_bit_equal_with_the_rope_parameters(name):
    hf = random_hf_model(name)
    config = gpt_config_from_hf(hf.config)
    original = hf.state_dict()
    back = to_hf_state_dict(from_hf_state_dict(original, config), config)
    assert back.keys() == {k for k in original if "rotary_emb" not in k}
    for key, t in back.items():
        assert torch.equal(t, original[key]), key
    exported = hf_config_from_gpt(config)
    assert type(exported).__name__ == SCALINGS[name][0]
    assert exported.rope_parameters == hf.config.rope_parameters == SCALINGS[name][1]
    assert gpt_config_from_hf(exported) == config
    again = transformers.AutoModelForCausalLM.from_config(exported).eval()
    again.load_state_dict(back, strict=True)
    with torch.no_grad():
        assert torch.equal(again(tokens()).logits, hf(tokens()).logits)


def test_older_rope_scaling_key_and_type_name_import_alike():
    """transformers' older configs say rope_scaling = {"type": ...}: the same scaling."""
    rope = dict(SCALINGS["yarn"][1])
    rope["type"] = rope.pop("rope_type")
    old = transformers.Qwen3Config(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, intermediate_size=96,
                                   max_position_embeddings=MAX, rope_scaling=rope)
    assert gpt_config_from_hf(old).rope_scaling == gpt_config_from_hf(hf_config("yarn")).rope_scaling


@pytest.mark.parametrize("rope,needle", [
    (dict(rope_type="dynamic", factor=2.0), "RoPE scaling type 'dynamic': ours are llama3, linear, yarn"),
    (dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32, truncate=False), "truncate false"),
    (dict(rope_type="linear", factor=2.0, partial_rotary_factor=0.5), "partial_rotary_factor 0.5"),
])
def test_scalings_our_layers_lack_are_refused_in_one_line(rope, needle):
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=MAX,
                                      rope_parameters={**rope, "rope_theta": 1e4})
    with pytest.raises(ValueError) as err:
        gpt_config_from_hf(config)
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("name", ["llama3", "yarn"])
def test_tools_carry_the_scaling_through_a_checkpoint(tmp_path, name):
    """import_hf writes the scaling's flags and saved args; the reference model of the checkpoint computes
    transformers' logits; export_hf writes the same tensors and rope_parameters back."""
    from safetensors.torch import load_file
    from megatron_ds.convert.reference import load_checkpoint_model
    vocab = 50257  # the GPT-2 tokenizer's, which the import checks the vocabulary with
    source = random_hf_model(name, vocab)
    source.save_pretrained(tmp_path / "hf")
    ckpt = tmp_path / "ckpt"
    assert tool("checkpoint/import_hf.py", "--input", tmp_path / "hf", "--output", ckpt, "--seq-length", SEQ) == 0
    flags = (ckpt / "megatron_ds_args.txt").read_text().split()
    assert flags[flags.index("--rope-scaling-type") + 1] == SCALINGS[name][1]["rope_type"]
    assert flags[flags.index("--rope-scaling-original-max-position-embeddings") + 1] == str(ORIGINAL)
    model, args, _ = load_checkpoint_model(ckpt)
    assert args.rope_scaling == {k: v for k, v in SCALINGS[name][1].items() if k != "rope_theta"}
    x = tokens(vocab)
    with torch.no_grad():
        diff = (model(x) - source(x).logits).abs().max().item()
    assert diff <= 1e-5, diff
    assert tool("checkpoint/export_hf.py", "--load", ckpt, "--output", tmp_path / "back") == 0
    before, after = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(before) == sorted(after)
    for key in before:
        assert torch.equal(before[key], after[key]), key
    saved = [json.loads((tmp_path / d / "config.json").read_text())["rope_parameters"] for d in ("hf", "back")]
    assert saved[0] == saved[1] == SCALINGS[name][1]
    # greedy generation through the K/V cache, past the original context: transformers' generate
    (tmp_path / "prompts.txt").write_text("The pipeline\n")
    assert tool("generate_samples_gpt.py", "--load", ckpt, "--sample-input-file", tmp_path / "prompts.txt",
                "--sample-output-file", tmp_path / "out.jsonl", "--output-format", "jsonl", "--greedy",
                "--out-seq-length", 48) == 0
    sample = json.loads((tmp_path / "out.jsonl").read_text())
    from megatron_ds.data.tokenizer import GPT2BPETokenizer, default_gpt2_files
    prompt = torch.tensor([GPT2BPETokenizer(*default_gpt2_files()).tokenize("The pipeline")])
    want = source.generate(prompt, do_sample=False, max_new_tokens=48, pad_token_id=vocab - 1)[0, prompt.shape[1]:]
    assert len(sample["tokens"]) == 48 and prompt.shape[1] + 48 > ORIGINAL
    assert sample["tokens"] == want.tolist()
