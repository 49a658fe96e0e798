"""Relative position encodings applied inside attention: rotary (RoPE) and ALiBi.

Both need the absolute position of each token. A pipeline stage sees only hidden
states, so positions are the token's index in the sequence: 0..s-1, or, inside a
Seq1F1B segment, the segment's offset onward (SegmentKVCache.current().offset); with
packed documents whose positions restart, RoPE takes them from the open micro-batch's
Documents (documents.py). ALiBi needs nothing more: its bias is a distance, the same
within a document whatever its first position.

RoPE uses the rotate-half layout (the two halves of a head are the pairs), as
Hugging Face's LLaMA and Megatron-LM do, so HF's q/k projections load unchanged.

Long-context scaling (megatron_ds/rope_scaling.py: linear, llama3, yarn) changes the inverse frequencies, which
inverse_frequencies alone computes for every table below, and for yarn multiplies cos and sin by the attention
factor: the whole sequence, a Seq1F1B segment, packed documents' positions and a compiled layer alike.
"""
import functools
import math

import torch


def inverse_frequencies(head_dim, theta, scaling=None, device=None):
    """The rotation's inverse frequencies (head_dim / 2,) in fp32, scaled by `scaling` (a RopeScaling, or None):
    transformers' rope init functions' values, operation for operation, so that they agree bit for bit."""
    channels = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    if scaling is not None and scaling.rope_type == "yarn":
        return _yarn(head_dim, theta, scaling, theta ** channels)
    inv_freq = 1.0 / theta ** channels
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    return _llama3(inv_freq, scaling)


def _llama3(inv_freq, s):
    """LLaMA 3.1: long wavelengths divided by the factor, short ones kept, those between blended."""
    original = s.original_max_position_embeddings
    wavelength = 2 * math.pi / inv_freq
    longest_kept, shortest_scaled = original / s.high_freq_factor, original / s.low_freq_factor
    scaled = torch.where(wavelength > shortest_scaled, inv_freq / s.factor, inv_freq)
    blend = (original / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - blend) * scaled / s.factor + blend * scaled
    between = ~(wavelength < longest_kept) * ~(wavelength > shortest_scaled)
    return torch.where(between, blended, scaled)


def _yarn(head_dim, theta, s, wavelengths):
    """YaRN: each dimension between interpolation (divided by the factor) and extrapolation (kept), by a ramp
    over the dimensions of the correction range. `wavelengths` are theta ** (2i / head_dim)."""
    kept, interpolated = 1.0 / wavelengths, 1.0 / (s.factor * wavelengths)
    low, high = s.yarn_correction_range(head_dim, theta)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = (1 - ramp).to(wavelengths.device)
    return interpolated * (1 - keep) + kept * keep


@functools.lru_cache(maxsize=64)
def _rope_cos_sin(head_dim, theta, start, length, device, dtype, scaling=None):
    """Cached per dtype too: a bf16 run casts its tables once, not in every layer of every op."""
    inv_freq = inverse_frequencies(head_dim, theta, scaling, device)
    angles = torch.arange(start, start + length, device=device).float()[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)  # (length, head_dim): each half rotates with its twin
    return _scaled_cos_sin(angles, scaling, dtype)


def _scaled_cos_sin(angles, scaling, dtype):
    """cos and sin of the angles (fp32), times yarn's attention factor, in `dtype`."""
    cos, sin = angles.cos(), angles.sin()
    scale = 1.0 if scaling is None else scaling.attention_scale
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_tables(head_dim, theta, start, length, device, dtype, scaling=None):
    """cos and sin (length, head_dim) of positions start..start+length-1, under RoPE scaling `scaling` (a
    RopeScaling, or None) (a compiled layer computes them in its graph, where they fuse with the rotation,
    instead of reading dynamo-opaque cached tensors)."""
    tables = _rope_cos_sin.__wrapped__ if torch.compiler.is_compiling() else _rope_cos_sin
    return tables(head_dim, theta, start, length, device, dtype, scaling)


def rope_tables_at(head_dim, theta, positions, dtype, scaling=None):
    """cos and sin (b, 1, s, head_dim) of the positions (b, s) of each token (packed documents, whose positions
    restart): the angles rope_tables makes of the same positions, bit for bit."""
    inv_freq = inverse_frequencies(head_dim, theta, scaling, positions.device)
    angles = positions.float().unsqueeze(-1) * inv_freq
    angles = torch.cat((angles, angles), dim=-1).unsqueeze(1)
    return _scaled_cos_sin(angles, scaling, dtype)


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
