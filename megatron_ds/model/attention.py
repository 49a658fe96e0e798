"""Causal self-attention through torch's scaled_dot_product_attention."""
import torch.nn as nn
import torch.nn.functional as F

from .config import GPTConfig
from .linear import Linear


class CausalSelfAttention(nn.Module):

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.c_attn = Linear(config.hidden_size, 3 * config.hidden_size)
        self.c_proj = Linear(config.hidden_size, config.hidden_size)
        self.attention_dropout = config.attention_dropout
        self.resid_drop = nn.Dropout(config.hidden_dropout)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.c_attn(x).split(h, dim=2)
        q, k, v = (t.view(b, s, self.num_heads, h // self.num_heads).transpose(1, 2) for t in (q, k, v))
        dropout = self.attention_dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        y = y.transpose(1, 2).reshape(b, s, h)
        return self.resid_drop(self.c_proj(y))
