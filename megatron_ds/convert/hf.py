"""Our model <-> Hugging Face's GPT2LMHeadModel, LlamaForCausalLM, BloomForCausalLM, Qwen3ForCausalLM,
MixtralForCausalLM and Qwen3MoeForCausalLM (their configs: hf_config.py).

Our parameters are keyed (global layer index, local name): 0 embedding, 1..L transformer
layers, L+1 final norm, L+2 the untied LM head (a tied head's weight is the embedding's,
under 0 only). Every conversion is a rename, a transpose (GPT-2's Conv1D stores [in, out]),
a split/concat along the output rows (our fused [q; k; v] and [gate; up] against LLaMA's
separate projections), a permutation of rows (BLOOM's fused projection interleaves
q, k, v per head) or a stack of the experts (HF's MoE models hold them as one tensor):
bit-exact both ways. Our RoPE has HF LLaMA's rotate-half layout, so q_proj/k_proj need
no permutation.
"""
from megatron_ds.gpt_config import GPTConfig
from .hf_config import SUPPORTED, gpt_config_from_hf, hf_config_from_gpt  # noqa: F401 (the configs, both ways)
from .hf_names import TIED_EMBEDDING, ignored_hf_key, model_name, rules


def to_hf_state_dict(params_by_layer: dict, config: GPTConfig) -> dict:
    """{(layer index, local name): tensor} -> the HF model's state dict (with lm_head.weight, the
    embedding's own tensor when the head is tied, as HF's state_dict() has it)."""
    sd, used = {}, set()
    for rule in rules(config):
        for keys, tensors in rule.export(params_by_layer, config):
            used.update(keys)
            sd.update(tensors)
    unused = set(params_by_layer) - used
    if unused:
        raise ValueError(f"parameters {sorted(unused)} have no place in a Hugging Face {config.family} model")
    if config.tied_head:
        sd["lm_head.weight"] = sd[TIED_EMBEDDING[config.family]]
    return sd


def from_hf_state_dict(hf_sd: dict, config: GPTConfig) -> dict:
    """The HF model's state dict, or its files' (experts one tensor each, as save_pretrained writes them) ->
    {(global layer index, local name): tensor}, the inverse of to_hf_state_dict. A key it does not know
    (other than HF's non-weight buffers) is an error."""
    names = {model_name(key, config): key for key in hf_sd}  # the model's name -> the key given
    sd = {name: hf_sd[key] for name, key in names.items()}
    out, used = {}, set()
    for rule in rules(config):
        for taken, tensors in rule.load(sd, config):
            used.update(taken)
            out.update(tensors)
    unknown = [key for name, key in names.items() if name not in used and not ignored_hf_key(name, config)]
    if unknown:
        raise ValueError(f"Hugging Face state dict keys {unknown[:8]} have no place in our {config.family} model")
    return out
