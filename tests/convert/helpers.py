"""Shared by the checkpoint-tool tests: tiny Hugging Face models built locally, training launches,
and the loss of a batch under either model."""
import json
import os
import subprocess
import sys

import numpy as np
import torch
import torch.nn.functional as F

from megatron_ds.testing.launcher import child_env
from megatron_ds.training.initialize import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS = os.path.join(ROOT, "tools")


def gpt2_files():
    from megatron_ds.data.tokenizer import default_gpt2_files
    return default_gpt2_files()


def tiny_hf_gpt2(path, vocab_size=50257, n_positions=32, with_tokenizer=False, seed=0):
    """A random 4-layer GPT-2 (hidden 32), no dropout, saved with save_pretrained."""
    import transformers
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=vocab_size, n_positions=n_positions, n_embd=32, n_layer=4, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config).eval()
    model.save_pretrained(path)
    if with_tokenizer:
        vocab, merges = gpt2_files()
        transformers.GPT2Tokenizer(vocab=vocab, merges=merges).save_pretrained(path)
    return model


def tiny_hf_family(family, path, num_layers=2):
    """A random LLaMA (GQA: 4 heads, 2 K/V heads, untied, no biases), Mixtral or Qwen3-MoE (the same, with 4
    experts, top-2; Qwen3-MoE's second layer dense, not renormalising the top-2, and its head_dim 16, twice
    hidden / heads as Qwen3-30B-A3B's: --kv-channels) or BLOOM, hidden 32, every tensor perturbed, saved with
    save_pretrained."""
    import transformers
    torch.manual_seed(0)
    rope = dict(vocab_size=50257, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
                bos_token_id=50256, eos_token_id=50256)
    if family == "llama":  # grouped-query attention, untied head, no biases
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**rope))
    elif family == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**rope, num_local_experts=4))
    elif family == "qwen3_moe":
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **rope, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, mlp_only_layers=[1],
            head_dim=16))
    else:
        config = transformers.BloomConfig(vocab_size=50257, hidden_size=32, n_layer=num_layers, n_head=4,
                                          bos_token_id=50256, eos_token_id=50256)
        model = transformers.BloomForCausalLM(config)
    with torch.no_grad():  # HF initialises norms to 1 and biases to 0: make every tensor count
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.eval().save_pretrained(path)
    return model


def batch_loss(logits, batch):
    """Mean next-token cross-entropy of (b, s+1) token rows, logits from batch[:, :-1]."""
    return float(F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten()))


@torch.no_grad()
def hf_loss(hf_model, batch):
    return batch_loss(hf_model(batch[:, :-1]).logits, batch)


def stack_samples(dataset, count):
    return torch.stack([torch.as_tensor(np.asarray(dataset[i]["text"], dtype=np.int64)) for i in range(count)])


def train(cwd, name, schedule, flags, nproc, timeout=900):
    """pretrain_gpt.py under torchrun with a ds_config naming `schedule`; returns (metrics records, output)."""
    ds_config = os.path.join(cwd, f"{name}.json")
    with open(ds_config, "w") as f:
        json.dump({"zero_optimization": {"stage": 1},
                   "pipeline": {"schedule": schedule, "partition_method": "type:transformer"}}, f)
    metrics = os.path.join(cwd, f"{name}.jsonl")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(free_port()), os.path.join(ROOT, "pretrain_gpt.py"), *flags,
           "--log-interval", "1", "--deepspeed", "--deepspeed_config", ds_config, "--metrics-file", metrics]
    env = child_env(ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{name} failed (rc {proc.returncode}):\n{out[-6000:]}"
    with open(metrics) as f:
        return [json.loads(line) for line in f], out


def tool(relpath, *argv):
    """main() of a tools/ script, in this process: (exit code)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(os.path.basename(relpath)[:-3], os.path.join(TOOLS, relpath))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main([str(a) for a in argv])
