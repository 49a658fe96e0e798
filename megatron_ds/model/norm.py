"""The norms: LayerNorm or RMSNorm (config.normalization) over the hidden size, and over each query and key
head (--qk-layernorm, Qwen3's q_norm/k_norm).

A head norm's weight is one vector of head_dim shared by every head. With tensor parallelism each rank holds
whole heads and the whole weight, which on a rank sees only its own heads: its gradient there is a share,
the sum over the TP group is the gradient. It is marked `tensor_parallel_partial`, and the engines sum it over
the TP group once per step with the sequence-parallel gradients (pipe/parallel/sequence_parallel.py), as Megatron's
finalize_model_grads sums its q/k layernorm gradients.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from megatron_ds.gpt_config import GPTConfig


class Norm(nn.Module):
    """LayerNorm or RMSNorm (config.normalization) over the last `size` channels (default the hidden size);
    parameters `weight` (and `bias` for LayerNorm)."""

    def __init__(self, config: GPTConfig, layer_idx: int = 0, size: int = 0):
        super().__init__()
        size = size or config.hidden_size
        self.rms = config.normalization == "rmsnorm"
        self.eps = config.layernorm_epsilon
        self.weight = nn.Parameter(torch.ones(size))
        self.bias = None if self.rms else nn.Parameter(torch.zeros(size))

    def forward(self, x):
        if self.rms:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class HeadNorm(Norm):
    """The norm of each query or key head: over head_dim of (b, s, heads, head_dim)."""

    def __init__(self, config: GPTConfig):
        super().__init__(config, size=config.head_dim)
        for p in self.parameters():
            p.tensor_parallel_partial = config.tensor_model_parallel_size > 1
