"""Hugging Face configs <-> GPTConfig, both ways: GPT-2, LLaMA, BLOOM, Qwen3, Mixtral and Qwen3-MoE, each the
options of our layers that make the family (gpt_config.hf_family). An HF option our layers lack is refused
with one line that names it. HF's head_dim is kv_channels (None where it is hidden / heads); GPT-2 and BLOOM have
none of their own, so a model with kv_channels exports as neither. RoPE scaling (HF's rope_parameters, older
configs' rope_scaling: linear, llama3 as LLaMA 3.1's, yarn as Qwen's long-context configs) is GPTConfig.rope_scaling
both ways, its keys as HF has them (rope_scaling.py); another rope_type is refused.

Mixture of experts. The routing is HF's: Mixtral's softmax, top-k, renormalised is our softmax over the top-k
logits; Qwen3-MoE's norm_topk_prob=False is --moe-router-pre-softmax. HF adds its balancing loss only with
output_router_logits, weighted by router_aux_loss_coef: --moe-aux-loss-coeff takes that coefficient (0 without
output_router_logits), but the losses are not the same. HF's (load_balancing_loss_func) is one loss over the
MoE layers together, E * sum_i f_i P_i, with f_i the assignments to expert i per token and P_i its mean
probability, both pooled over every layer's tokens; ours (Megatron's) is one loss per layer,
E / k * sum_i f_i P_i, summed over the layers. With one layer ours is HF's over k; with L layers the gradients
agree only where every layer routes alike and the coefficient is scaled by k / L. So only the coefficient maps.
The options that act in training only and HF lacks (the z-loss, seq_aux_loss, expert parallelism) are not
exported.
"""
from megatron_ds.gpt_config import GPTConfig, hf_family
from megatron_ds.moe_config import MoEConfig, compact_layer_freq, layer_pattern
from megatron_ds.rope_scaling import RopeScaling

SUPPORTED = ("gpt2", "llama", "bloom", "qwen3", "mixtral", "qwen3_moe")
BLOOM_DEFAULT_POSITIONS = 2048  # ALiBi has no position table: BLOOM's training length, unless overridden


def _unsupported(hf_config, why=""):
    archs = getattr(hf_config, "architectures", None)
    return ValueError(f"Hugging Face model_type {getattr(hf_config, 'model_type', None)!r} (architectures {archs}) "
                      f"is not supported{': ' + why if why else ''}; supported model types: {', '.join(SUPPORTED)}")


def _require(hf_config, ok, why):
    if not ok:
        raise _unsupported(hf_config, why)


def _gpt2_fields(c):
    _require(c, c.activation_function in ("gelu_new", "gelu_pytorch_tanh"),
             f"activation_function {c.activation_function!r} (ours is GELU's tanh approximation, gelu_new)")
    _require(c, c.scale_attn_weights and not c.scale_attn_by_inverse_layer_idx,
             "attention scaled other than by 1/sqrt(head size)")
    return dict(hidden_size=c.n_embd, num_layers=c.n_layer, num_attention_heads=c.n_head,
                max_position_embeddings=c.n_positions, ffn_hidden_size=c.n_inner or 0,
                hidden_dropout=c.resid_pdrop, attention_dropout=c.attn_pdrop, layernorm_epsilon=c.layer_norm_epsilon)


def _rope_fields(c):
    """What LLaMA, Qwen3, Mixtral and Qwen3-MoE share (RMSNorm, SwiGLU, RoPE, grouped K/V heads), checked."""
    rope = dict(getattr(c, "rope_parameters", None) or {"rope_theta": getattr(c, "rope_theta", 10000.0)})
    scaling = None
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        try:
            scaling = RopeScaling.from_dict(rope)
        except ValueError as exc:
            raise _unsupported(c, str(exc)) from None
    _require(c, c.hidden_act == "silu", f"hidden_act {c.hidden_act!r} (ours is SwiGLU: silu)")
    window = getattr(c, "sliding_window", None)
    _require(c, window is None or window >= c.max_position_embeddings,
             f"sliding_window {window} (ours attends to every earlier position)")
    return dict(hidden_size=c.hidden_size, num_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                num_key_value_heads=c.num_key_value_heads, max_position_embeddings=c.max_position_embeddings,
                ffn_hidden_size=c.intermediate_size, attention_dropout=c.attention_dropout,
                layernorm_epsilon=c.rms_norm_eps, normalization="rmsnorm", swiglu=True,
                position_embedding_type="rope", rope_theta=rope["rope_theta"], rope_scaling=scaling,
                add_bias_linear=False,
                kv_channels=getattr(c, "head_dim", None))  # hidden / heads when None or equal (GPTConfig's None)


def _llama_fields(c):
    _require(c, c.attention_bias == c.mlp_bias, "attention_bias != mlp_bias (ours is one --disable-bias-linear)")
    return {**_rope_fields(c), "add_bias_linear": c.attention_bias}


def _qwen3_fields(c):
    _require(c, not c.attention_bias, "attention_bias (Qwen3's MLP has none; ours is one --disable-bias-linear)")
    return {**_rope_fields(c), "qk_layernorm": True}


def _aux_loss_coeff(c):
    return c.router_aux_loss_coef if c.output_router_logits else 0.0


def _mixtral_fields(c):
    _require(c, not c.router_jitter_noise,
             f"router_jitter_noise {c.router_jitter_noise} (ours routes the hidden states unperturbed)")
    return {**_rope_fields(c), "moe": MoEConfig(num_experts=c.num_local_experts, router_topk=c.num_experts_per_tok,
                                                ffn_hidden_size=c.intermediate_size, aux_loss_coeff=_aux_loss_coeff(c))}


def _qwen3_moe_fields(c):
    dense = set(c.mlp_only_layers or ())
    pattern = [int(c.num_experts > 0 and i not in dense and (i + 1) % c.decoder_sparse_step == 0)
               for i in range(c.num_hidden_layers)]
    _require(c, any(pattern), "no layer with experts (num_experts, decoder_sparse_step, mlp_only_layers)")
    moe = MoEConfig(num_experts=c.num_experts, router_topk=c.num_experts_per_tok,
                    ffn_hidden_size=c.moe_intermediate_size, pre_softmax=not c.norm_topk_prob,
                    layer_freq=compact_layer_freq(pattern), aux_loss_coeff=_aux_loss_coeff(c))
    return {**_qwen3_fields(c), "moe": moe}


def _bloom_fields(c):
    _require(c, not c.apply_residual_connection_post_layernorm, "apply_residual_connection_post_layernorm")
    return dict(hidden_size=c.hidden_size, num_layers=c.n_layer, num_attention_heads=c.n_head,
                max_position_embeddings=BLOOM_DEFAULT_POSITIONS, hidden_dropout=c.hidden_dropout,
                attention_dropout=c.attention_dropout, layernorm_epsilon=c.layer_norm_epsilon,
                position_embedding_type="alibi", embed_layernorm=True)


_FIELDS = {"gpt2": _gpt2_fields, "llama": _llama_fields, "bloom": _bloom_fields, "qwen3": _qwen3_fields,
           "mixtral": _mixtral_fields, "qwen3_moe": _qwen3_moe_fields}


def gpt_config_from_hf(hf_config, **overrides) -> GPTConfig:
    """The GPTConfig of an HF config of a SUPPORTED model type; `overrides` set GPTConfig fields
    (e.g. seed, dropout, max_position_embeddings for BLOOM, which has no position limit)."""
    fields = _FIELDS.get(getattr(hf_config, "model_type", None))
    if fields is None:
        raise _unsupported(hf_config)
    common = dict(vocab_size=hf_config.vocab_size, init_method_std=hf_config.initializer_range,
                  untie_embeddings_and_output_weights=not getattr(hf_config, "tie_word_embeddings", True))
    return GPTConfig(**{**common, **fields(hf_config), **overrides})


def _gpt2_config(c):
    return "GPT2Config", dict(
        architectures=["GPT2LMHeadModel"], n_embd=c.hidden_size, n_layer=c.num_layers, n_head=c.num_attention_heads,
        n_positions=c.max_position_embeddings, n_inner=c.ffn_hidden_size, activation_function="gelu_new",
        resid_pdrop=c.hidden_dropout, embd_pdrop=c.hidden_dropout, attn_pdrop=c.attention_dropout,
        layer_norm_epsilon=c.layernorm_epsilon)


def _rope_config(c):
    rope = dict(rope_theta=c.rope_theta) if c.rope_scaling is None else dict(
        rope_parameters={**c.rope_scaling.as_dict(), "rope_theta": c.rope_theta})
    return dict(hidden_size=c.hidden_size, num_hidden_layers=c.num_layers, num_attention_heads=c.num_attention_heads,
                num_key_value_heads=c.num_key_value_heads, intermediate_size=c.ffn_hidden_size,
                max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.layernorm_epsilon,
                hidden_act="silu", attention_dropout=c.attention_dropout,
                head_dim=c.head_dim, **rope)  # Qwen3's default head_dim is 128, whatever hidden / heads


def _llama_config(c):
    return "LlamaConfig", dict(architectures=["LlamaForCausalLM"], **_rope_config(c), attention_bias=c.add_bias_linear,
                               mlp_bias=c.add_bias_linear)


def _qwen3_config(c):
    return "Qwen3Config", dict(architectures=["Qwen3ForCausalLM"], **_rope_config(c),
                               attention_bias=False, use_sliding_window=False)


def _aux_config(m):
    """HF's balancing loss: on (output_router_logits) with our coefficient, or off."""
    coeff = m.aux_loss_coeff if m.load_balancing_type != "none" else 0.0
    return dict(output_router_logits=True, router_aux_loss_coef=coeff) if coeff else dict(output_router_logits=False)


def _mixtral_config(c):
    m = c.moe
    return "MixtralConfig", dict(architectures=["MixtralForCausalLM"], **{**_rope_config(c),
                                 "intermediate_size": m.ffn_hidden_size}, num_local_experts=m.num_experts,
                                 num_experts_per_tok=m.router_topk, router_jitter_noise=0.0, **_aux_config(m))


def _qwen3_moe_config(c):
    m = c.moe
    dense = [i for i, on in enumerate(layer_pattern(m.layer_freq, c.num_layers)) if not on]
    return "Qwen3MoeConfig", dict(architectures=["Qwen3MoeForCausalLM"], **_rope_config(c),
                                  attention_bias=False, use_sliding_window=False, num_experts=m.num_experts,
                                  num_experts_per_tok=m.router_topk, moe_intermediate_size=m.ffn_hidden_size,
                                  norm_topk_prob=not m.pre_softmax, decoder_sparse_step=1, mlp_only_layers=dense,
                                  **_aux_config(m))


def _bloom_config(c):
    return "BloomConfig", dict(
        architectures=["BloomForCausalLM"], hidden_size=c.hidden_size, n_layer=c.num_layers,
        n_head=c.num_attention_heads, layer_norm_epsilon=c.layernorm_epsilon, hidden_dropout=c.hidden_dropout,
        attention_dropout=c.attention_dropout)


_CONFIGS = {"gpt2": _gpt2_config, "llama": _llama_config, "bloom": _bloom_config, "qwen3": _qwen3_config,
            "mixtral": _mixtral_config, "qwen3_moe": _qwen3_moe_config}


def hf_config_from_gpt(config: GPTConfig, **extra):
    """The HF config of config.family; `extra` goes to the HF config (token ids, dtype, ...)."""
    import transformers
    family, why = hf_family(config)
    if family not in _CONFIGS:
        raise ValueError(f"these model options match no Hugging Face family ({', '.join(SUPPORTED)}): {why or config}")
    class_name, fields = _CONFIGS[family](config)
    common = dict(vocab_size=config.vocab_size, initializer_range=config.init_method_std,
                  tie_word_embeddings=config.tied_head)
    return getattr(transformers, class_name)(**{**common, **fields, **extra})
