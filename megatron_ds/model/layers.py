"""The GPT layers, one class per pipeline layer. nanoGPT-shaped; no pipeline logic.

A pipeline is the list [Embedding, TransformerLayer x L, FinalNorm, LM head (the
Embedding again when tied, else LMHead)]; the single-process reference chains the
same classes. The model families are options on these classes (see config.py).
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


class Norm(nn.Module):
    """LayerNorm or RMSNorm (config.normalization); parameters `weight` (and `bias` for LayerNorm)."""

    def __init__(self, config: GPTConfig, layer_idx: int = 0):
        super().__init__()
        self.rms = config.normalization == "rmsnorm"
        self.eps = config.layernorm_epsilon
        self.weight = nn.Parameter(torch.ones(config.hidden_size))
        self.bias = None if self.rms else nn.Parameter(torch.zeros(config.hidden_size))

    def forward(self, x):
        if self.rms:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class Embedding(nn.Module):
    """Word embeddings, learned absolute position embeddings (rope and alibi act in attention
    instead), optionally a norm after them (BLOOM). Input: (tokens, position_ids)."""

    def __init__(self, config: GPTConfig, layer_idx: int = 0):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        learned = config.position_embedding_type == "learned_absolute"
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size) if learned else None
        self.ln_emb = Norm(config) if config.embed_layernorm else None
        self.drop = nn.Dropout(config.hidden_dropout)
        gen = _generator(config, layer_idx)
        with torch.no_grad():
            self.wte.weight.normal_(0.0, config.init_method_std, generator=gen)
            if self.wpe is not None:
                self.wpe.weight.normal_(0.0, config.init_method_std, generator=gen)

    def forward(self, inputs):
        tokens, position_ids = inputs
        x = self.wte(tokens)
        if self.wpe is not None:
            x = x + self.wpe(position_ids)
        if self.ln_emb is not None:
            x = self.ln_emb(x)
        return self.drop(x)


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
    """The tied LM head is the word embedding, transposed."""
    return F.linear(hidden, embedding.wte.weight)


class LMHead(Linear):
    """The untied LM head (--untie-embeddings-and-output-weights): a pipeline layer of its own,
    whose weight GEMM a B/W split defers like any other linear layer's."""

    def __init__(self, config: GPTConfig, layer_idx: int):
        super().__init__(config.hidden_size, config.vocab_size, bias=False)
        _init_linear(self, config.init_method_std, _generator(config, layer_idx))


class MLP(nn.Module):
    """GELU (tanh approximation), or SwiGLU: c_fc gives [gate; up], silu(gate) * up goes to c_proj."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.swiglu = config.swiglu
        fc_size = 2 * config.ffn_hidden_size if self.swiglu else config.ffn_hidden_size
        self.c_fc = Linear(config.hidden_size, fc_size, bias=config.add_bias_linear)
        self.c_proj = Linear(config.ffn_hidden_size, config.hidden_size, bias=config.add_bias_linear)
        self.drop = nn.Dropout(config.hidden_dropout)

    def forward(self, x):
        x = self.c_fc(x)
        if self.swiglu:
            gate, up = x.chunk(2, dim=-1)
            x = F.silu(gate) * up
        else:
            x = F.gelu(x, approximate="tanh")
        return self.drop(self.c_proj(x))


class TransformerLayer(nn.Module):
    """Pre-norm GPT block."""

    def __init__(self, config: GPTConfig, layer_idx: int):
        super().__init__()
        self.ln_1 = Norm(config)
        self.attn = CausalSelfAttention(config, layer_idx)
        self.ln_2 = Norm(config)
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


class FinalNorm(Norm):
    """The norm after the last transformer layer: a pipeline layer of its own."""


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
