"""The name and layout rules behind hf.py: one rule per parameter of ours (per group of experts), per family.

A Rule maps our (layer index, local name) to one or more Hugging Face names and converts the tensor(s)
both ways, only by transposing, splitting/concatenating rows or permuting rows; Experts maps a MoE layer's
experts.{e}.NAME, one tensor per expert, to HF's stacked (experts, ...) tensor by stacking. So the round
trip is bit-exact.

Hugging Face's MoE models (transformers v5) hold their experts stacked, but save_pretrained writes them one
tensor per expert, the layout of the Hub's files, which HF's loader stacks again: Experts reads either.
Mixtral's files also call the block `block_sparse_moe` where the model says `mlp` (model_name).
"""
from dataclasses import dataclass
from typing import Callable, Optional

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
    layers: Optional[Callable] = None  # LAYER: (config, global layer index) -> whether it has this parameter

    def keys(self, config):
        """(our key, HF names) for every layer this rule covers."""
        L = config.num_layers
        if self.where == LAYER:
            return [((i + 1, self.ours), [n.format(i=i) for n in self.theirs]) for i in range(L)
                    if self.layers is None or self.layers(config, i + 1)]
        idx = {EMBED: 0, FINAL: L + 1, HEAD: L + 2}[self.where]
        return [((idx, self.ours), list(self.theirs))]

    def export(self, params, config):
        """(our keys used, {HF name: tensor}) of each parameter, from {our key: tensor}."""
        for key, names in self.keys(config):
            if key not in params:
                raise ValueError(f"no parameter {key} for Hugging Face's {names}")
            yield [key], dict(zip(names, self.to_hf(params[key].detach())))

    def load(self, hf_sd, config):
        """(HF names used, {our key: tensor}) of each parameter, from HF's {name: tensor}."""
        for key, names in self.keys(config):
            missing = [n for n in names if n not in hf_sd]
            if missing:
                raise ValueError(f"Hugging Face state dict lacks {missing} (for our {key})")
            yield names, {key: self.from_hf([hf_sd[n] for n in names])}


@dataclass
class Experts:
    """The experts of each MoE layer: our experts.{e}.NAME <-> HF's stacked tensor `theirs` (experts first), or
    on file one tensor per expert per name of `on_file` ("{e}": the expert), whose rows, in order, are ours."""
    ours: str
    theirs: str
    on_file: tuple

    def _layers(self, config):
        experts = range(config.moe.num_experts)
        return [(i, [(i + 1, self.ours.format(e=e)) for e in experts]) for i in range(config.num_layers)
                if config.is_moe_layer(i + 1)]

    def export(self, params, config):
        for i, keys in self._layers(config):
            name = self.theirs.format(i=i)
            missing = [key for key in keys if key not in params]
            if missing:
                raise ValueError(f"no parameter {missing[0]} for Hugging Face's {name}")
            yield keys, {name: torch.stack([params[key].detach() for key in keys])}

    def load(self, hf_sd, config):
        for i, keys in self._layers(config):
            name = self.theirs.format(i=i)
            if name in hf_sd:
                if hf_sd[name].shape[0] != len(keys):
                    raise ValueError(f"Hugging Face's {name} holds {hf_sd[name].shape[0]} experts, config.json's "
                                     f"model {len(keys)}")
                yield [name], dict(zip(keys, hf_sd[name].unbind(0)))
                continue
            files = [[n.format(i=i, e=e) for n in self.on_file] for e in range(len(keys))]
            missing = [n for names in files for n in names if n not in hf_sd]
            if missing:
                raise ValueError(f"Hugging Face state dict lacks {name} (or, per expert, {missing[:2]}) "
                                 f"(for our layer {i + 1} {self.ours.format(e='*')})")
            yield [n for names in files for n in names], {
                key: torch.cat([hf_sd[n] for n in names]) if len(names) > 1 else hf_sd[names[0]]
                for key, names in zip(keys, files)}


def _linear(c, ours, theirs, weight=SAME, bias=SAME, layers=None):
    """A transformer layer's linear layer: weight, and bias when the model has them.
    `theirs`: HF's module name, or several when HF splits our fused rows. `layers`: as Rule's."""
    theirs = [theirs] if isinstance(theirs, str) else theirs
    out = [Rule(LAYER, f"{ours}.weight", tuple(f"{n}.weight" for n in theirs), *weight, layers=layers)]
    if c.add_bias_linear:
        out.append(Rule(LAYER, f"{ours}.bias", tuple(f"{n}.bias" for n in theirs), *bias, layers=layers))
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


def _dense_layer(config, idx):
    return not config.is_moe_layer(idx)


def _moe_layer(config, idx):
    return config.is_moe_layer(idx)


def _llama(c):
    """LLaMA; with --qk-layernorm Qwen3; with experts Mixtral, or Qwen3-MoE, whose dense layers are LLaMA's."""
    h = "model.layers.{i}."
    kv = c.num_key_value_heads * c.head_dim
    qkv, gate_up = split_rows([c.query_projection_size, kv, kv]), split_rows([c.ffn_hidden_size, c.ffn_hidden_size])
    dense = None if c.moe is None else _dense_layer
    out = [Rule(EMBED, "wte.weight", ("model.embed_tokens.weight",)),
           *_norm(LAYER, "ln_1.", h + "input_layernorm.", c),
           *_linear(c, "attn.c_attn", [h + f"self_attn.{p}_proj" for p in "qkv"], qkv, qkv),
           *_linear(c, "attn.c_proj", h + "self_attn.o_proj"),
           *_norm(LAYER, "ln_2.", h + "post_attention_layernorm.", c),
           *_linear(c, "mlp.c_fc", [h + "mlp.gate_proj", h + "mlp.up_proj"], gate_up, gate_up, layers=dense),
           *_linear(c, "mlp.c_proj", h + "mlp.down_proj", layers=dense),
           *_norm(FINAL, "", "model.norm.", c)]
    if c.qk_layernorm:
        out += [*_norm(LAYER, "attn.q_norm.", h + "self_attn.q_norm.", c),
                *_norm(LAYER, "attn.k_norm.", h + "self_attn.k_norm.", c)]
    if c.moe is not None:
        gate, up, down = _EXPERT_FILES[c.family]
        x = h + "mlp.experts."
        out += [Rule(LAYER, "mlp.router.weight", (h + "mlp.gate.weight",), layers=_moe_layer),
                Experts("mlp.experts.{e}.fc1.weight", x + "gate_up_proj", (x + "{e}." + gate, x + "{e}." + up)),
                Experts("mlp.experts.{e}.fc2.weight", x + "down_proj", (x + "{e}." + down,))]
    return out


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


_FAMILIES = {"gpt2": _gpt2, "llama": _llama, "bloom": _bloom, "qwen3": _llama, "mixtral": _llama, "qwen3_moe": _llama}
TIED_EMBEDDING = {"gpt2": "transformer.wte.weight", "bloom": "transformer.word_embeddings.weight",
                  **{f: "model.embed_tokens.weight" for f in ("llama", "qwen3", "mixtral", "qwen3_moe")}}
# an expert's weights on file: [gate; up] (our fc1) and down (fc2)
_EXPERT_FILES = {"mixtral": ("w1.weight", "w3.weight", "w2.weight"),
                 "qwen3_moe": ("gate_proj.weight", "up_proj.weight", "down_proj.weight")}
_FILE_NAMES = {"mixtral": (".block_sparse_moe.", ".mlp.")}  # the files' name -> the model's
_BUFFERS = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")  # HF buffers, not weights


def rules(config):
    if config.family not in _FAMILIES:
        raise ValueError(f"these model options match no Hugging Face family ({', '.join(_FAMILIES)}): {config}")
    out = _FAMILIES[config.family](config)
    if not config.tied_head:
        out.append(Rule(HEAD, "weight", ("lm_head.weight",)))
    return out


def model_name(key, config):
    """The name in HF's model of a key of its files (they differ for Mixtral's MoE blocks)."""
    old, new = _FILE_NAMES.get(config.family, ("", ""))
    return key.replace(old, new) if old else key


def ignored_hf_key(key, config):
    return key.endswith(_BUFFERS) or (config.tied_head and key == "lm_head.weight")
