"""One-to-one names between our layers and Hugging Face's GPT2LMHeadModel.

HF's GPT-2 uses Conv1D, which stores weights as [in, out]: our Linear's weights
are transposed on the way.
"""
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def hf_name(layer_idx: int, local_name: str, num_layers: int) -> str:
    if layer_idx == 0:
        return f"transformer.{local_name}"  # wte.weight, wpe.weight
    if layer_idx <= num_layers:
        return f"transformer.h.{layer_idx - 1}.{local_name}"
    if layer_idx == num_layers + 1:
        return f"transformer.ln_f.{local_name}"
    raise ValueError(f"layer {layer_idx} is the tied LM head: it maps to transformer.wte.weight")


def is_transposed(local_name: str) -> bool:
    return local_name in _CONV1D


def to_hf_state_dict(params_by_layer: dict, num_layers: int) -> dict:
    """{(layer index, local name): tensor} -> a GPT2LMHeadModel state dict (lm_head tied to wte)."""
    sd = {}
    for (idx, name), tensor in params_by_layer.items():
        t = tensor.detach()
        sd[hf_name(idx, name, num_layers)] = t.t().contiguous() if is_transposed(name) else t.clone()
    sd["lm_head.weight"] = sd["transformer.wte.weight"]
    return sd


def from_hf_state_dict(hf_sd: dict, num_layers: int) -> dict:
    """The inverse of to_hf_state_dict, keyed by (layer index, local name)."""
    out = {}
    for key, t in hf_sd.items():
        if key == "lm_head.weight" or not key.startswith("transformer.") or key.endswith(".attn.bias"):
            continue
        rest = key[len("transformer."):]
        if rest.startswith("h."):
            i, name = rest[2:].split(".", 1)
            idx = int(i) + 1
        elif rest.startswith("ln_f."):
            idx, name = num_layers + 1, rest[len("ln_f."):]
        else:
            idx, name = 0, rest
        out[(idx, name)] = t.t().contiguous() if is_transposed(name) else t
    return out
