"""Causal self-attention through torch's scaled_dot_product_attention.

One fused projection c_attn gives [q (heads x d); k (kv heads x d); v (kv heads x d)]:
with grouped-query attention (fewer K/V heads) each K/V head serves heads / kv heads
query heads, and K/V stay grouped all the way (SDPA's enable_gqa; the Seq1F1B cache
holds the grouped heads). RoPE rotates q and k; ALiBi is an additive bias.
"""
import torch.nn as nn
import torch.nn.functional as F

from .config import GPTConfig
from .kv_cache import SegmentKVCache
from .linear import Linear
from .positions import alibi_bias, apply_rope


class CausalSelfAttention(nn.Module):

    def __init__(self, config: GPTConfig, layer_idx: int = 0):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                            config.head_dim)
        kv_size = self.num_kv_heads * self.head_dim
        self.split_sizes = [config.hidden_size, kv_size, kv_size]
        self.c_attn = Linear(config.hidden_size, sum(self.split_sizes), bias=config.add_bias_linear)
        self.c_proj = Linear(config.hidden_size, config.hidden_size, bias=config.add_bias_linear)
        self.position_embedding_type, self.rope_theta = config.position_embedding_type, config.rope_theta
        self.attention_dropout = config.attention_dropout
        self.resid_drop = nn.Dropout(config.hidden_dropout)
        self.layer_idx = layer_idx  # the global layer index names this layer's slot in the segment K/V cache

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.c_attn(x).split(self.split_sizes, dim=2)
        q = q.view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k, v = (t.view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2) for t in (k, v))
        segment = SegmentKVCache.current()
        if self.position_embedding_type == "rope":
            q, k = apply_rope(q, k, self.rope_theta, segment.offset if segment is not None else 0)
        if segment is not None:  # a sequence segment (Seq1F1B): also attend to the earlier segments
            k, v = segment.extend(self.layer_idx, k, v)
            # k, v now live in the cache: copy q so it alone does not keep the fused qkv output alive
            # (in the projection's (b, s, heads, d) memory order, so y reshapes without a copy)
            q = q.transpose(1, 2).contiguous().transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, **self._mask(q, k, segment),
                                           dropout_p=self.attention_dropout if self.training else 0.0,
                                           enable_gqa=self.num_kv_heads != self.num_heads)
        y = y.transpose(1, 2).reshape(b, s, h)
        return self.resid_drop(self.c_proj(y))

    def _mask(self, q, k, segment):
        """SDPA's mask arguments: causal (bottom-right aligned for a segment), plus ALiBi's bias."""
        if self.position_embedding_type == "alibi":
            return dict(attn_mask=alibi_bias(self.num_heads, q.shape[-2], k.shape[-2], q.dtype, q.device))
        mask = segment.causal_mask(q, k) if segment is not None else None
        return dict(attn_mask=mask, is_causal=mask is None)
