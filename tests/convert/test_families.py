"""LLaMA-, Mixtral-, Qwen3-MoE- and BLOOM-style Hugging Face models through the tools, on one process: import,
export back bit for bit as the same HF class, and our checkpoint's perplexity and greedy text equal HF's."""
import json

import pytest
import torch
from safetensors.torch import load_file

from tests.convert.helpers import hf_loss, tiny_hf_family, tool


@pytest.mark.parametrize("family,cls", [("llama", "LlamaForCausalLM"), ("bloom", "BloomForCausalLM"),
                                        ("mixtral", "MixtralForCausalLM"), ("qwen3_moe", "Qwen3MoeForCausalLM")])
def test_family_round_trip_perplexity_and_greedy(tmp_path, family, cls):
    from transformers import AutoModelForCausalLM
    source = tiny_hf_family(family, tmp_path / "hf")
    ckpt = tmp_path / "ckpt"
    assert tool("checkpoint/import_hf.py", "--input", tmp_path / "hf", "--output", ckpt, "--seq-length", 32) == 0
    flags = (ckpt / "megatron_ds_args.txt").read_text().split()
    llama = ["--swiglu", "--untie-embeddings-and-output-weights", "--disable-bias-linear"]
    for flag in {"llama": llama, "bloom": ["--embed-layernorm"],
                 "mixtral": llama + ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64"],
                 "qwen3_moe": llama + ["--qk-layernorm", "--num-experts", "--moe-router-pre-softmax",
                                       "--moe-ffn-hidden-size", "24"]}[family]:
        assert flag in flags
    if family == "qwen3_moe":  # mlp_only_layers=[1]: experts in every second layer from the first
        assert flags[flags.index("--moe-layer-freq") + 1] == "2"
        assert flags[flags.index("--kv-channels") + 1] == "16"  # head_dim 16, not 32 / 4
        layer = torch.load(ckpt / "global_step0" / "layer_01-model_states.pt")
        assert layer["attn.c_attn.weight"].shape == (4 * 16 + 2 * 2 * 16, 32)
        assert layer["attn.c_proj.weight"].shape == (32, 4 * 16)
    else:
        assert "--kv-channels" not in flags
    if family != "bloom":
        assert (ckpt / "global_step0" / "layer_04-model_states.pt").is_file()  # the untied head, layer L + 2
    if family in ("mixtral", "qwen3_moe"):
        layer = torch.load(ckpt / "global_step0" / "layer_01-model_states.pt")
        assert layer["mlp.experts.3.fc1.weight"].shape == (2 * (64 if family == "mixtral" else 24), 32)
    assert tool("checkpoint/export_hf.py", "--load", ckpt, "--output", tmp_path / "back") == 0
    before, after = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(before) == sorted(after)
    for name in before:
        assert torch.equal(before[name], after[name]), name
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(back).__name__ == cls
    # perplexity of our checkpoint on a token stream = HF's loss over the same window
    stream = torch.randint(0, 1000, (1, 25), generator=torch.Generator().manual_seed(1))
    from megatron_ds.data.tokenizer import default_gpt2_files
    from megatron_ds.data.tokenizer import GPT2BPETokenizer
    tok = GPT2BPETokenizer(*default_gpt2_files())
    text = tok.detokenize(stream[0].tolist())
    ids = torch.tensor([tok.tokenize(text) + [50256]])
    assert ids.shape[1] <= 33
    (tmp_path / "held_out.jsonl").write_text(json.dumps({"text": text}) + "\n")
    assert tool("evaluate_gpt.py", "--load", ckpt, "--valid-data", tmp_path / "held_out.jsonl",
                "--results-file", tmp_path / "eval.json") == 0
    got = json.loads((tmp_path / "eval.json").read_text())
    assert got["tokens"] == ids.shape[1] - 1
    assert got["loss"] == pytest.approx(hf_loss(source, ids), rel=1e-5)
    # greedy text from our checkpoint = HF generate
    (tmp_path / "prompts.txt").write_text("The pipeline\n")
    assert tool("generate_samples_gpt.py", "--load", ckpt, "--sample-input-file", tmp_path / "prompts.txt",
                "--sample-output-file", tmp_path / "out.jsonl", "--output-format", "jsonl", "--greedy",
                "--out-seq-length", 12) == 0
    sample = json.loads((tmp_path / "out.jsonl").read_text())
    prompt = torch.tensor([tok.tokenize("The pipeline")])
    want = source.generate(prompt, do_sample=False, max_new_tokens=12, pad_token_id=50256)[0, prompt.shape[1]:]
    assert sample["tokens"] == want.tolist()
