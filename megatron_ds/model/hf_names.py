"""The name and layout rules behind hf.py: one Rule per parameter of ours, per family.

A Rule maps our (layer index, local name) to one or more Hugging Face names and
converts the tensor(s) both ways, only by transposing, splitting/concatenating rows
or permuting rows, so the round trip is bit-exact.
"""
from dataclasses import dataclass
from typing import Callable

import torch

EMBED, LAYER, FINAL, HEAD = "embed", "layer", "final", "head"

# (to_hf: tensor -> [tensors], from_hf: [tensors] -> tensor)
SAME = (lambda t: [t.clone()], lambda ts: ts[0])
TRANSPOSED = (lambda t: [t.t().contiguous()], lambda ts: ts[0].t().contiguous())  # GPT-2's Conv1D: [in, out]


def split_rows(sizes):
    """Our fused rows <-> HF's separate projections ([q; k; v], [gate; up])."""
    return lambda t: [p.contiguous() for p in t.split(sizes)], lambda ts: torch.cat(ts)


def per_head(heads):
    """Our rows [q heads; k heads; v heads] <-> BLOOM's [q, k, v of head 0; of head 1; ...]."""
    def swap(t, a, b):
        return t.reshape(a, b, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape).contiguous()
    return lambda t: [swap(t, 3, heads)], lambda ts: swap(ts[0], heads, 3)


@dataclass
class Rule:
    where: str  # EMBED (index 0), LAYER (1..L; "{i}" in a name is HF's 0-based layer), FINAL (L+1), HEAD (L+2)
    ours: str
    theirs: tuple
    to_hf: Callable = SAME[0]
    from_hf: Callable = SAME[1]

    def keys(self, config):
        """(our key, HF names) for every layer this rule covers."""
        L = config.num_layers
        if self.where == LAYER:
            return [((i + 1, self.ours), [n.format(i=i) for n in self.theirs]) for i in range(L)]
        idx = {EMBED: 0, FINAL: L + 1, HEAD: L + 2}[self.where]
        return [((idx, self.ours), list(self.theirs))]


def _linear(c, ours, theirs, weight=SAME, bias=SAME):
    """A transformer layer's linear layer: weight, and bias when the model has them.
    `theirs`: HF's module name, or several when HF splits our fused rows."""
    theirs = [theirs] if isinstance(theirs, str) else theirs
    out = [Rule(LAYER, f"{ours}.weight", tuple(f"{n}.weight" for n in theirs), *weight)]
    if c.add_bias_linear:
        out.append(Rule(LAYER, f"{ours}.bias", tuple(f"{n}.bias" for n in theirs), *bias))
    return out


def _norm(where, ours, theirs, config):
    names = ["weight"] if config.normalization == "rmsnorm" else ["weight", "bias"]
    return [Rule(where, f"{ours}{n}", (f"{theirs}{n}",)) for n in names]


def _gpt2(c):
    h = "transformer.h.{i}."
    out = [Rule(EMBED, "wte.weight", ("transformer.wte.weight",)),
           Rule(EMBED, "wpe.weight", ("transformer.wpe.weight",)),
           *_norm(LAYER, "ln_1.", h + "ln_1.", c), *_norm(LAYER, "ln_2.", h + "ln_2.", c),
           *_norm(FINAL, "", "transformer.ln_f.", c)]
    for ours in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
        out += _linear(c, ours, h + ours, weight=TRANSPOSED)
    return out


def _llama(c):
    h = "model.layers.{i}."
    kv = c.num_key_value_heads * c.head_dim
    qkv, gate_up = split_rows([c.hidden_size, kv, kv]), split_rows([c.ffn_hidden_size, c.ffn_hidden_size])
    return [Rule(EMBED, "wte.weight", ("model.embed_tokens.weight",)),
            *_norm(LAYER, "ln_1.", h + "input_layernorm.", c),
            *_linear(c, "attn.c_attn", [h + f"self_attn.{p}_proj" for p in "qkv"], qkv, qkv),
            *_linear(c, "attn.c_proj", h + "self_attn.o_proj"),
            *_norm(LAYER, "ln_2.", h + "post_attention_layernorm.", c),
            *_linear(c, "mlp.c_fc", [h + "mlp.gate_proj", h + "mlp.up_proj"], gate_up, gate_up),
            *_linear(c, "mlp.c_proj", h + "mlp.down_proj"),
            *_norm(FINAL, "", "model.norm.", c)]


def _bloom(c):
    h = "transformer.h.{i}."
    qkv = per_head(c.num_attention_heads)
    return [Rule(EMBED, "wte.weight", ("transformer.word_embeddings.weight",)),
            *_norm(EMBED, "ln_emb.", "transformer.word_embeddings_layernorm.", c),
            *_norm(LAYER, "ln_1.", h + "input_layernorm.", c),
            *_linear(c, "attn.c_attn", h + "self_attention.query_key_value", qkv, qkv),
            *_linear(c, "attn.c_proj", h + "self_attention.dense"),
            *_norm(LAYER, "ln_2.", h + "post_attention_layernorm.", c),
            *_linear(c, "mlp.c_fc", h + "mlp.dense_h_to_4h"),
            *_linear(c, "mlp.c_proj", h + "mlp.dense_4h_to_h"),
            *_norm(FINAL, "", "transformer.ln_f.", c)]


_FAMILIES = {"gpt2": _gpt2, "llama": _llama, "bloom": _bloom}
TIED_EMBEDDING = {"gpt2": "transformer.wte.weight", "llama": "model.embed_tokens.weight",
                  "bloom": "transformer.word_embeddings.weight"}
_BUFFERS = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")  # HF buffers, not weights


def rules(config):
    if config.family not in _FAMILIES:
        raise ValueError(f"these model options match no Hugging Face family ({', '.join(_FAMILIES)}): {config}")
    out = _FAMILIES[config.family](config)
    if not config.tied_head:
        out.append(Rule(HEAD, "weight", ("lm_head.weight",)))
    return out


def ignored_hf_key(key, config):
    return key.endswith(_BUFFERS) or (config.tied_head and key == "lm_head.weight")
