"""The model's Hugging Face mapping, as the checkpoint tools use it.

    gpt_config_from_hf(hf_config) -> GPTConfig
    hf_config_from_gpt(config, **extra) -> PretrainedConfig
    to_hf_state_dict(params_by_layer, config) -> {HF name: tensor}
    from_hf_state_dict(hf_sd, config) -> {(global layer index, local name): tensor}

megatron_ds.model.hf owns the mapping of each model family. Where it does not yet
offer this interface (GPT-2 only, keyed by num_layers), GPT-2's is built here on top.
"""
from megatron_ds.model import hf as _hf

if hasattr(_hf, "gpt_config_from_hf"):
    from megatron_ds.model.hf import (from_hf_state_dict, gpt_config_from_hf,  # noqa: F401
                                      hf_config_from_gpt, to_hf_state_dict)
else:
    from megatron_ds.model.config import GPTConfig

    _GELU_TANH = ("gelu_new", "gelu_pytorch_tanh")

    def gpt_config_from_hf(hf_config):
        if hf_config.model_type != "gpt2":
            raise ValueError(f"model_type {hf_config.model_type!r} is not supported (supported: 'gpt2')")
        if hf_config.activation_function not in _GELU_TANH:
            raise ValueError(f"activation_function {hf_config.activation_function!r} is not supported "
                             f"(supported: {', '.join(_GELU_TANH)})")
        if hf_config.scale_attn_by_inverse_layer_idx or not hf_config.scale_attn_weights:
            raise ValueError("scale_attn_by_inverse_layer_idx=true / scale_attn_weights=false are not supported")
        return GPTConfig(vocab_size=hf_config.vocab_size, hidden_size=hf_config.n_embd, num_layers=hf_config.n_layer,
                         num_attention_heads=hf_config.n_head, max_position_embeddings=hf_config.n_positions,
                         ffn_hidden_size=hf_config.n_inner or 0, hidden_dropout=hf_config.resid_pdrop,
                         attention_dropout=hf_config.attn_pdrop, layernorm_epsilon=hf_config.layer_norm_epsilon,
                         init_method_std=hf_config.initializer_range)

    def hf_config_from_gpt(config, **extra):
        from transformers import GPT2Config
        return GPT2Config(vocab_size=config.vocab_size, n_positions=config.max_position_embeddings,
                          n_embd=config.hidden_size, n_layer=config.num_layers, n_head=config.num_attention_heads,
                          n_inner=config.ffn_hidden_size, activation_function="gelu_new",
                          resid_pdrop=config.hidden_dropout, embd_pdrop=config.hidden_dropout,
                          attn_pdrop=config.attention_dropout, layer_norm_epsilon=config.layernorm_epsilon,
                          initializer_range=config.init_method_std, tie_word_embeddings=True,
                          architectures=["GPT2LMHeadModel"], **extra)

    def to_hf_state_dict(params_by_layer, config):
        return _hf.to_hf_state_dict(params_by_layer, config.num_layers)

    def from_hf_state_dict(hf_sd, config):
        return _hf.from_hf_state_dict(hf_sd, config.num_layers)
