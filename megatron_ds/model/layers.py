"""The GPT-2 layers, one class per pipeline layer. nanoGPT-shaped; no pipeline logic.

A pipeline is the list [Embedding, TransformerLayer x L, FinalNorm, LM head (the
Embedding again, tied)]; the single-process reference chains the same classes.
Each layer initialises itself from its own seed (config.seed + global layer
index), so any partition into pipeline stages gives the same weights.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import CausalSelfAttention
from .config import GPTConfig
from .linear import Linear


def _generator(config: GPTConfig, layer_idx: int):
    return torch.Generator().manual_seed(config.seed + layer_idx)


def _init_linear(linear: nn.Linear, std: float, gen: torch.Generator):
    with torch.no_grad():
        linear.weight.normal_(0.0, std, generator=gen)
        if linear.bias is not None:
            linear.bias.zero_()


class Embedding(nn.Module):
    """Word and learned absolute position embeddings. Input: (tokens, position_ids)."""

    def __init__(self, config: GPTConfig, layer_idx: int = 0):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.drop = nn.Dropout(config.hidden_dropout)
        gen = _generator(config, layer_idx)
        with torch.no_grad():
            self.wte.weight.normal_(0.0, config.init_method_std, generator=gen)
            self.wpe.weight.normal_(0.0, config.init_method_std, generator=gen)

    def forward(self, inputs):
        tokens, position_ids = inputs
        return self.drop(self.wte(tokens) + self.wpe(position_ids))


class TiedLMHead(nn.Module):
    """The LM head's copy of the word embedding, on a rank that lacks the Embedding.

    It holds only `wte` (a stage without the embedding has no use for positions),
    initialised exactly like Embedding.wte; DeepSpeed keeps the two copies tied.
    """

    def __init__(self, config: GPTConfig, layer_idx: int = 0):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        with torch.no_grad():
            self.wte.weight.normal_(0.0, config.init_method_std, generator=_generator(config, layer_idx))


def lm_head(embedding, hidden):
    """The LM head is the word embedding, transposed (tied weights)."""
    return F.linear(hidden, embedding.wte.weight)


class MLP(nn.Module):

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = Linear(config.hidden_size, config.ffn_hidden_size)
        self.c_proj = Linear(config.ffn_hidden_size, config.hidden_size)
        self.drop = nn.Dropout(config.hidden_dropout)

    def forward(self, x):
        return self.drop(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class TransformerLayer(nn.Module):
    """Pre-LayerNorm GPT-2 block."""

    def __init__(self, config: GPTConfig, layer_idx: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.mlp = MLP(config)
        gen = _generator(config, layer_idx)
        std = config.init_method_std
        scaled_std = std / math.sqrt(2.0 * config.num_layers)  # GPT-2's residual-branch scaling
        _init_linear(self.attn.c_attn, std, gen)
        _init_linear(self.attn.c_proj, scaled_std, gen)
        _init_linear(self.mlp.c_fc, std, gen)
        _init_linear(self.mlp.c_proj, scaled_std, gen)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class FinalNorm(nn.LayerNorm):

    def __init__(self, config: GPTConfig, layer_idx: int = 0):
        super().__init__(config.hidden_size, eps=config.layernorm_epsilon)


def gpt_loss(logits, labels):
    """Mean token cross-entropy, computed in fp32 as Megatron does.

    `labels` is a tensor, or (labels, num_tokens) when a micro-batch is split into
    sequence segments: each segment's loss is then divided by the whole
    micro-batch's token count, so the segment losses sum to the full loss.
    """
    if isinstance(labels, (tuple, list)):
        labels, num_tokens = labels
        losses = F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), reduction="sum")
        return losses / num_tokens
    return F.cross_entropy(logits.float().flatten(0, -2), labels.flatten())
