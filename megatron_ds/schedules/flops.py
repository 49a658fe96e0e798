"""The model's FLOPs, counted once (pure Python): the TFLOP/s and MFU the training log prints, the
Seq1F1B balanced split and its segment costs ("auto" weighs segments with them), and the "flops"
layer partition all take their numbers from here.

Forward FLOPs of one transformer layer for the tokens [a, b) of a sequence (a multiply-add is 2):
- linear layers, per token: Q, K, V 2h(q + 2 kv d) (grouped-query attention: kv K/V heads of size
  d = h / heads, or --kv-channels; q = heads x d, which is h unless --kv-channels), output projection 2qh,
  MLP 2hf x 2 matrices (GELU) or x 3 (SwiGLU: gate, up, down);
- causal attention: the query at position t scores t keys and sums t values, 4qt, which over
  [a, b) integrates to 2q(b^2 - a^2): half of the full s x s count that Megatron's formula uses. Under a
  document mask a query sees its own document's earlier tokens only: the Seq1F1B split then counts the
  corpus's average (attention_flops' `keys`).
The LM head adds 2hV per token (tied or not, the GEMM is the same); embedding lookups, norms and
elementwise work are not counted. A mixture-of-experts layer counts the experts a token runs through
(layer_shapes). Training is forward + backward = 3x forward (4x when activations
are recomputed).
"""
from __future__ import annotations


def _get(config, name, default=None):
    value = getattr(config, name, None)
    return default if value in (None, 0) else value


def query_width(hidden: int, heads: int | None = None, head_dim: int | None = None) -> int:
    """heads x head size: the queries' and the attention output's width (hidden unless head_dim says otherwise)."""
    return heads * head_dim if heads and head_dim else hidden


def linear_flops_per_token(hidden: int, ffn: int | None = None, heads: int | None = None,
                           kv_heads: int | None = None, swiglu: bool = False, head_dim: int | None = None) -> float:
    """Forward FLOPs of one layer's linear layers per token (ffn None: 4h; kv_heads None: heads; head_dim None:
    hidden / heads)."""
    ffn = 4 * hidden if ffn is None else ffn
    q = query_width(hidden, heads, head_dim)
    kv_width = q if not heads or not kv_heads else kv_heads * (q // heads)
    return 2.0 * hidden * (q + 2 * kv_width) + 2.0 * q * hidden + (3 if swiglu else 2) * 2.0 * hidden * ffn


def attention_flops(a: float, b: float, hidden: int, keys=None) -> float:
    """Forward FLOPs of causal attention (scores and weighted sum) for the tokens [a, b). `keys`: under a
    document mask (--reset-attention-mask) the prefix sums K of the keys each position's query sees on average
    (data/document_stats.py): 4h (K[b] - K[a]) instead of causal's 4h sum t. `hidden`: the queries' width, heads x
    head size (query_width)."""
    if keys is not None:
        return 4.0 * hidden * (keys[int(b)] - keys[int(a)])
    return 2.0 * hidden * (b * b - a * a)


def span_flops(a: float, b: float, hidden: int, ffn: int | None = None, heads: int | None = None,
               kv_heads: int | None = None, swiglu: bool = False, keys=None, head_dim: int | None = None) -> float:
    """Forward FLOPs of one transformer layer for the tokens [a, b) of a sequence (`keys`: attention_flops'); the
    attention's scores and sums are as wide as the queries."""
    return (linear_flops_per_token(hidden, ffn, heads, kv_heads, swiglu, head_dim) * (b - a)
            + attention_flops(a, b, query_width(hidden, heads, head_dim), keys))


def layer_shape(config) -> dict:
    """The keyword arguments of span_flops from a GPTConfig or the parsed flags."""
    return dict(hidden=config.hidden_size, ffn=_get(config, "ffn_hidden_size"),
                heads=_get(config, "num_attention_heads"), kv_heads=_get(config, "num_key_value_heads"),
                swiglu=bool(getattr(config, "swiglu", False)), head_dim=_get(config, "kv_channels"))


def layer_shapes(config) -> list[dict]:
    """layer_shape of each transformer layer. A mixture-of-experts layer's MLP is what a token runs through:
    its top-k experts and the shared expert, as one MLP of their summed widths (the router's 2 h E per
    token is left out, as the norms are); `config` a GPTConfig, or the parsed flags (their gpt_config)."""
    dense = layer_shape(config)
    moe = getattr(config, "moe", None) or getattr(getattr(config, "gpt_config", None), "moe", None)
    if moe is None:
        return [dense] * config.num_layers
    routed = moe.router_topk * (moe.ffn_hidden_size or dense["ffn"] or 4 * dense["hidden"])
    sparse = {**dense, "ffn": routed + moe.shared_expert_intermediate_size}
    return [sparse if moe.is_moe_layer(i, config.num_layers) else dense for i in range(config.num_layers)]


def vocab_size(config) -> int:
    return _get(config, "padded_vocab_size") or _get(config, "vocab_size") or 50304


def model_flops_per_sequence(config, seq_length: int, recompute: bool = False) -> float:
    """Training FLOPs (forward + backward, + a forward again when recomputing) of one sequence."""
    layers = sum(span_flops(0, seq_length, **shape) for shape in layer_shapes(config))
    forward = layers + 2.0 * config.hidden_size * vocab_size(config) * seq_length
    return (4.0 if recompute else 3.0) * forward
