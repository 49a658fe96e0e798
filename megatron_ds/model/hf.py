"""Our model <-> Hugging Face's GPT2LMHeadModel, LlamaForCausalLM and BloomForCausalLM.

Our parameters are keyed (global layer index, local name): 0 embedding, 1..L transformer
layers, L+1 final norm, L+2 the untied LM head (a tied head's weight is the embedding's,
under 0 only). Every conversion is a rename, a transpose (GPT-2's Conv1D stores [in, out]),
a split/concat along the output rows (our fused [q; k; v] and [gate; up] against LLaMA's
separate projections) or a permutation of rows (BLOOM's fused projection interleaves
q, k, v per head): bit-exact both ways. Our RoPE has HF LLaMA's rotate-half layout, so
q_proj/k_proj need no permutation.
"""
from megatron_ds.gpt_config import GPTConfig
from .hf_names import TIED_EMBEDDING, ignored_hf_key, rules

SUPPORTED = ("gpt2", "llama", "bloom")
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


def _llama_fields(c):
    rope = dict(getattr(c, "rope_parameters", None) or {"rope_theta": getattr(c, "rope_theta", 10000.0)})
    _require(c, rope.get("rope_type", "default") == "default", f"RoPE scaling {rope}")
    _require(c, c.hidden_act == "silu", f"hidden_act {c.hidden_act!r} (ours is SwiGLU: silu)")
    _require(c, getattr(c, "head_dim", None) in (None, c.hidden_size // c.num_attention_heads),
             f"head_dim {c.head_dim} other than hidden_size / num_attention_heads")
    _require(c, c.attention_bias == c.mlp_bias, "attention_bias != mlp_bias (ours is one --disable-bias-linear)")
    return dict(hidden_size=c.hidden_size, num_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                num_key_value_heads=c.num_key_value_heads, max_position_embeddings=c.max_position_embeddings,
                ffn_hidden_size=c.intermediate_size, attention_dropout=c.attention_dropout,
                layernorm_epsilon=c.rms_norm_eps, normalization="rmsnorm", swiglu=True,
                position_embedding_type="rope", rope_theta=rope["rope_theta"], add_bias_linear=c.attention_bias)


def _bloom_fields(c):
    _require(c, not c.apply_residual_connection_post_layernorm, "apply_residual_connection_post_layernorm")
    return dict(hidden_size=c.hidden_size, num_layers=c.n_layer, num_attention_heads=c.n_head,
                max_position_embeddings=BLOOM_DEFAULT_POSITIONS, hidden_dropout=c.hidden_dropout,
                attention_dropout=c.attention_dropout, layernorm_epsilon=c.layer_norm_epsilon,
                position_embedding_type="alibi", embed_layernorm=True)


def gpt_config_from_hf(hf_config, **overrides) -> GPTConfig:
    """The GPTConfig of a GPT2Config, LlamaConfig or BloomConfig; `overrides` set GPTConfig fields
    (e.g. seed, dropout, max_position_embeddings for BLOOM, which has no position limit)."""
    fields = {"gpt2": _gpt2_fields, "llama": _llama_fields, "bloom": _bloom_fields}.get(
        getattr(hf_config, "model_type", None))
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


def _llama_config(c):
    return "LlamaConfig", dict(
        architectures=["LlamaForCausalLM"], hidden_size=c.hidden_size, num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        intermediate_size=c.ffn_hidden_size, max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.layernorm_epsilon, rope_theta=c.rope_theta, hidden_act="silu",
        attention_bias=c.add_bias_linear, mlp_bias=c.add_bias_linear, attention_dropout=c.attention_dropout)


def _bloom_config(c):
    return "BloomConfig", dict(
        architectures=["BloomForCausalLM"], hidden_size=c.hidden_size, n_layer=c.num_layers,
        n_head=c.num_attention_heads, layer_norm_epsilon=c.layernorm_epsilon, hidden_dropout=c.hidden_dropout,
        attention_dropout=c.attention_dropout)


def hf_config_from_gpt(config: GPTConfig, **extra):
    """GPT2Config / LlamaConfig / BloomConfig for config.family; `extra` goes to the HF config
    (token ids, dtype, ...)."""
    import transformers
    make = {"gpt2": _gpt2_config, "llama": _llama_config, "bloom": _bloom_config}.get(config.family)
    if make is None:
        raise ValueError(f"these model options match no Hugging Face family ({', '.join(SUPPORTED)}): {config}")
    class_name, fields = make(config)
    common = dict(vocab_size=config.vocab_size, initializer_range=config.init_method_std,
                  tie_word_embeddings=config.tied_head)
    return getattr(transformers, class_name)(**{**common, **fields, **extra})


def to_hf_state_dict(params_by_layer: dict, config: GPTConfig) -> dict:
    """{(layer index, local name): tensor} -> the HF model's state dict (with lm_head.weight, the
    embedding's own tensor when the head is tied, as HF's state_dict() has it)."""
    sd, used = {}, set()
    for rule in rules(config):
        for key, names in rule.keys(config):
            if key not in params_by_layer:
                raise ValueError(f"no parameter {key} for Hugging Face's {names}")
            used.add(key)
            for name, t in zip(names, rule.to_hf(params_by_layer[key].detach())):
                sd[name] = t
    unused = set(params_by_layer) - used
    if unused:
        raise ValueError(f"parameters {sorted(unused)} have no place in a Hugging Face {config.family} model")
    if config.tied_head:
        sd["lm_head.weight"] = sd[TIED_EMBEDDING[config.family]]
    return sd


def from_hf_state_dict(hf_sd: dict, config: GPTConfig) -> dict:
    """The HF model's state dict -> {(global layer index, local name): tensor}, the inverse of
    to_hf_state_dict. A key it does not know (other than HF's non-weight buffers) is an error."""
    out, used = {}, set()
    for rule in rules(config):
        for key, names in rule.keys(config):
            missing = [n for n in names if n not in hf_sd]
            if missing:
                raise ValueError(f"Hugging Face state dict lacks {missing} (for our {key})")
            used.update(names)
            out[key] = rule.from_hf([hf_sd[n] for n in names])
    unknown = [k for k in hf_sd if k not in used and not ignored_hf_key(k, config)]
    if unknown:
        raise ValueError(f"Hugging Face state dict keys {unknown[:8]} have no place in our {config.family} model")
    return out
