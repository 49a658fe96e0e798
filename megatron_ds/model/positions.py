"""Relative position encodings applied inside attention: rotary (RoPE) and ALiBi.

Both need the absolute position of each token. A pipeline stage sees only hidden
states, so positions are the token's index in the sequence: 0..s-1, or, inside a
Seq1F1B segment, the segment's offset onward (SegmentKVCache.current().offset); with
packed documents whose positions restart, RoPE takes them from the open micro-batch's
Documents (documents.py). ALiBi needs nothing more: its bias is a distance, the same
within a document whatever its first position.

RoPE uses the rotate-half layout (the two halves of a head are the pairs), as
Hugging Face's LLaMA and Megatron-LM do, so HF's q/k projections load unchanged.
"""
import functools
import math

import torch


@functools.lru_cache(maxsize=64)
def _rope_cos_sin(head_dim, theta, start, length, device, dtype):
    """Cached per dtype too: a bf16 run casts its tables once, not in every layer of every op."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim)
    angles = torch.arange(start, start + length, device=device).float()[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)  # (length, head_dim): each half rotates with its twin
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_tables(head_dim, theta, start, length, device, dtype):
    """cos and sin (length, head_dim) of positions start..start+length-1 (a compiled layer computes them in its
    graph, where they fuse with the rotation, instead of reading dynamo-opaque cached tensors)."""
    tables = _rope_cos_sin.__wrapped__ if torch.compiler.is_compiling() else _rope_cos_sin
    return tables(head_dim, theta, start, length, device, dtype)


def rope_tables_at(head_dim, theta, positions, dtype):
    """cos and sin (b, 1, s, head_dim) of the positions (b, s) of each token (packed documents, whose positions
    restart): the angles rope_tables makes of the same positions, bit for bit."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float()
                                / head_dim)
    angles = positions.float().unsqueeze(-1) * inv_freq
    angles = torch.cat((angles, angles), dim=-1).unsqueeze(1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(q, k, cos, sin):
    """Rotate q and k (b, heads, s, head_dim) by the angles whose rope_tables are cos, sin."""
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def alibi_slopes(num_heads):
    """The ALiBi paper's head slopes: a geometric sequence from 2^(-8/n); for a head count that is
    not a power of two, the closest power's slopes then every other slope of the next power's."""
    def geometric(n):
        base = 2.0 ** (-8.0 / n)
        return [base ** (i + 1) for i in range(n)]
    closest = 2 ** int(math.floor(math.log2(num_heads)))
    return geometric(closest) + geometric(2 * closest)[0::2][:num_heads - closest]


@functools.lru_cache(maxsize=16)
def alibi_bias(num_heads, lq, lk, dtype, device, queries_reversed=False):
    """Additive attention bias (heads, lq, lk): -slope x distance to each visible key, -inf for the
    future. Queries are the last lq of the lk positions (a segment sees all earlier keys), last
    position first when `queries_reversed` (a Seq1F1B segment's order on CPU, see kv_cache.py)."""
    slopes = torch.tensor(alibi_slopes(num_heads), dtype=torch.float32, device=device)
    query_pos = torch.arange(lk - lq, lk, device=device)
    distance = ((query_pos.flip(0) if queries_reversed else query_pos)[:, None]
                - torch.arange(lk, device=device)[None, :]).float()
    bias = -slopes[:, None, None] * distance
    return bias.masked_fill_(distance < 0, float("-inf")).to(dtype)
