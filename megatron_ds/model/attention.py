"""Causal self-attention through torch's scaled_dot_product_attention."""
import itertools

import torch.nn as nn
import torch.nn.functional as F

from .config import GPTConfig
from .kv_cache import SegmentKVCache
from .linear import Linear

_layer_ids = itertools.count()


class CausalSelfAttention(nn.Module):

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.c_attn = Linear(config.hidden_size, 3 * config.hidden_size)
        self.c_proj = Linear(config.hidden_size, config.hidden_size)
        self.attention_dropout = config.attention_dropout
        self.resid_drop = nn.Dropout(config.hidden_dropout)
        self.layer_id = next(_layer_ids)  # names this layer's slot in the segment K/V cache

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.c_attn(x).split(h, dim=2)
        q, k, v = (t.view(b, s, self.num_heads, h // self.num_heads).transpose(1, 2) for t in (q, k, v))
        mask = None
        segment = SegmentKVCache.current()
        if segment is not None:  # a sequence segment (Seq1F1B): also attend to the earlier segments
            k, v = segment.extend(self.layer_id, k, v)
            # k, v now live in the cache: copy q so it alone does not keep the fused qkv output alive
            # (in the projection's (b, s, heads, d) memory order, so y reshapes without a copy)
            q = q.transpose(1, 2).contiguous().transpose(1, 2)
            mask = segment.causal_mask(q, k)
        dropout = self.attention_dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None)
        y = y.transpose(1, 2).reshape(b, s, h)
        return self.resid_drop(self.c_proj(y))
